"""The Hugging Face Trainer example (examples/hf_lm.py) under Baton, each figure against a
baseline measured in the same run:

1. Throughput: steps/s of the example's `train(ctx)` under Baton — a `RunContext` driven
   in-process on a file store, its checkpoints committed by the real commit protocol
   afterwards (as tests/baton/harness.py does) — divided by steps/s of the same script run
   bare (`hf.training_arguments`/`hf.fit` swapped for plain `TrainingArguments` with
   `save_steps` and `trainer.train()`), the same checkpoint cadence, alternating rounds.
   Goal >= 0.98.
2. Kill -> first resumed step: Baton on the real stack (as bench/recovery.py, "SIGKILL,
   supervised") against torchrun (`--max-restarts 1`, bench/hf_torchrun.py, its worker
   SIGKILLed), the same Trainer job, cadence and pace. Goal: Baton faster.

    .venv/bin/python -m bench.frameworks [--rounds 3] [--pairs 10] [--every 50]
                                         [--only throughput|recovery]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

import examples.hf_lm as hf_lm
from baton.integrations import hf
from baton.runtime.context import RunContext
from bench import torchrun
from bench.hf_torchrun import CONFIG, SEED
from shared.checkpoint import commit
from shared.config import Settings
from shared.contracts import JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, FromChild
from shared.contracts.events import Event, Progress, Restored, Started
from shared.contracts.records import RunState
from tests.baton.harness import RUN, Run
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[1]

# -- 1. throughput ---------------------------------------------------------------------

STEPS, EVERY, WARMUP = 300, 50, 20
"""A run of 300 steps, a checkpoint every 50 by default (examples/hf_lm.toml's cadence);
steps/s is taken from the end of step 20 to the end of step 300, so it covers the saves at
50, 100, ..., 250 (a save at step k comes between the ends of steps k and k + 1; the save at
300 comes after the last step's end)."""


class StepClock(TrainerCallback):
    """The time (wall and process CPU) of every step's end, the steps a checkpoint was saved
    at, and every logged loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.steps: list[int] = []
        self.saves: list[int] = []
        self.losses: list[float] = []
        """Each logged loss: the same in both runs if they trained alike."""
        self.in_baton: list[float] = []
        """Seconds of each call into Baton's callback (under Baton only)."""

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.steps.append(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.saves.append(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def rate(self, warmup: int) -> float:
        assert self.steps == list(range(1, len(self.steps) + 1)), "a step's end missing"
        span = self.times[-1] - self.times[warmup - 1]
        return (len(self.times) - warmup) / span

    def windows(self, every: int) -> list[float]:
        """Seconds of each window of `every` steps from one save's step to the next (each
        holds exactly one save): a load spike on this shared machine slows a window or two,
        not the median or the fastest."""
        t = self.times  # t[k - 1]: the end of step k
        return [t[k + every - 1] - t[k - 1] for k in range(every, len(t) - every + 1, every)]

    def cpu_per_step(self, warmup: int) -> float:
        """CPU seconds of the whole process (every thread: the writer's too) per step."""
        return (self.cpu[-1] - self.cpu[warmup - 1]) / (len(self.cpu) - warmup)


@contextlib.contextmanager
def timed_callback(spent: list[float]) -> Iterator[None]:
    """Appends the seconds each call into `BatonCallback` (step end, log, save) took."""
    originals = {n: getattr(hf.BatonCallback, n) for n in ("on_step_end", "on_log", "on_save")}

    def timed(method: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            began = time.perf_counter()
            method(*args, **kwargs)
            spent.append(time.perf_counter() - began)

        return call

    for name, method in originals.items():
        setattr(hf.BatonCallback, name, timed(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(hf.BatonCallback, name, method)


@contextlib.contextmanager
def swapped(
    training_arguments: Callable[..., TrainingArguments], fit: Callable[[Any, Trainer], None]
) -> Iterator[None]:
    """examples/hf_lm.py calls `hf.training_arguments` and `hf.fit` through the module:
    swap them for the run's own, and put them back."""
    saved = hf.training_arguments, hf.fit
    hf.training_arguments, hf.fit = training_arguments, fit  # type: ignore[assignment]
    try:
        yield
    finally:
        hf.training_arguments, hf.fit = saved


def bare(root: Path, every: int) -> StepClock:
    """The example's script without Baton: plain arguments, `trainer.train()`."""
    clock = StepClock()

    def arguments(ctx: Any, **kwargs: Any) -> TrainingArguments:
        return TrainingArguments(
            output_dir=str(root / "out"),
            save_strategy="steps",
            save_steps=every,
            save_total_limit=2,  # as hf.training_arguments: the same rotation of old ones
            max_steps=STEPS,
            logging_steps=1,
            report_to="none",
            disable_tqdm=True,
            seed=SEED,
            data_seed=SEED,
            **kwargs,
        )

    def fit(ctx: Any, trainer: Trainer) -> None:
        trainer.add_callback(clock)
        trainer.train()

    with swapped(arguments, fit):
        stand_in = SimpleNamespace(config=dict(CONFIG), seed=SEED, total_steps=STEPS)
        hf_lm.train(cast(RunContext, stand_in))  # it reads config, seed, total_steps only
    return clock


def under_baton(root: Path, every: int) -> StepClock:
    """The example's `train(ctx)` as a training process runs it, in-process: a RunContext
    on a file store, its checkpoints committed once it is done (the trainer service commits
    them in another process, outside the training loop). `logging_steps = 1` is added to its
    arguments, so it prints every step's line as the bare run does."""
    clock = StepClock()
    spec = convert(
        {
            "name": "hf-lm", "entry_point": "examples.hf_lm:train", "total_steps": STEPS,
            "seed": SEED, "deterministic": True, "checkpoint": {"every_steps": every},
            "config": dict(CONFIG),
        },
        JobSpec,
    )  # fmt: skip
    run = Run(root, spec)
    run.token = 1
    sent: list[FromChild] = []
    ctx = RunContext(Task(run_id=RUN, spec=spec), 1, run.store_url, root / "spool", sent.append)
    make, fit = hf.training_arguments, hf.fit

    def arguments(ctx: RunContext, **kwargs: Any) -> TrainingArguments:
        # Baton has the Trainer log every step but print every `logging_steps` (10 unless
        # given): print every step, as the bare run with `logging_steps = 1` does.
        return cast(TrainingArguments, make(ctx, **{"logging_steps": 1, **kwargs}))

    def timed_fit(ctx: RunContext, trainer: Trainer) -> None:
        trainer.add_callback(clock)
        fit(ctx, trainer)

    with swapped(arguments, timed_fit), timed_callback(clock.in_baton):
        try:
            hf_lm.train(ctx)
        finally:
            ctx.close()
    ready = [m for m in sent if isinstance(m, CheckpointReady)]
    for r in ready:
        run.commit(r)
    latest = asyncio.run(commit.read_latest(run.store, RUN))
    assert latest is not None and latest[0].step == STEPS, latest
    assert [r.step for r in ready] == clock.saves, (ready, clock.saves)
    return clock


Measure = dict[str, float]


def throughput(pairs: int, every: int) -> tuple[dict[str, list[Measure]], list[int], bool]:
    """Alternating runs (bare, Baton, bare, Baton, ...) after one unmeasured pair; the steps
    saved at, and whether every run logged the same losses."""
    got: dict[str, list[Measure]] = {"bare": [], "baton": []}
    saves: dict[str, list[int]] = {}
    losses: list[list[float]] = []
    for r in range(pairs + 1):
        for name, body in (("bare", bare), ("baton", under_baton)):
            with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp, quiet():
                clock = body(Path(tmp), every)
            saves.setdefault(name, clock.saves)
            assert clock.saves == saves["bare"], f"{name} saved at {clock.saves}"
            assert len(clock.losses) == STEPS, f"{name} logged {len(clock.losses)} losses"
            losses.append(clock.losses)
            if r > 0:
                got[name].append({
                    "steps/s": clock.rate(WARMUP),
                    "steps/s, median window": every / statistics.median(clock.windows(every)),
                    "steps/s, fastest window": every / min(clock.windows(every)),
                    "process CPU ms/step": clock.cpu_per_step(WARMUP) * 1000,
                    "in Baton's callback ms/step": sum(clock.in_baton) / STEPS * 1000,
                })  # fmt: skip
    return got, saves["bare"], all(run == losses[0] for run in losses)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The Trainer prints every step's log (`logging_steps = 1`, no progress bar) and a
    progress bar per save: to /dev/null, for both."""
    with (
        open(os.devnull, "w") as null,
        contextlib.redirect_stdout(null),
        contextlib.redirect_stderr(null),
    ):
        yield


# -- 2. kill -> first resumed step ---------------------------------------------------------

TOTAL, CADENCE, KILL_AT, PACE = 120, 20, 50, 0.02
"""The job: 120 steps, a checkpoint every 20, each step followed by a 20 ms pace; the
training process is killed once step 50 is seen (its last checkpoint: step 40)."""


Phases = dict[str, float]
"""Seconds from the signal to the first resumed step ("total"), and its parts."""


async def baton_kill(r: int) -> tuple[Phases, int, str]:
    """bench/recovery.py's "SIGKILL, supervised" with the Trainer job: seconds from the
    signal to the next attempt's first `progress` (and its parts), that step, and which
    trainer took the run over. The job is
    examples/hf_lm.py's `train` with the step log torchrun's worker writes
    (`bench.hf_torchrun:baton_train`), for the time of the first resumed step's end."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        steps = Path(tmp) / "steps.txt"
        stack = Stack(Path(tmp) / "s", trainers=0, lease_ttl=Settings().lease_ttl_s)
        try:
            await stack.start(("dispatcher", "checkpointer", "reaper"))
            for trainer in ("t1", "t2"):
                await stack.add_trainer(trainer, restart=True)
            nc = await stack.client()
            spec = job(
                entry_point="bench.hf_torchrun:baton_train", total_steps=TOTAL, seed=SEED,
                deterministic=True, checkpoint={"every_steps": CADENCE},
                config={**CONFIG, "pace": PACE, "step_log": str(steps)},
                idempotency_key=f"hf-kill-{r}",
            )  # fmt: skip
            run_id = await submit(nc, spec)
            log = EventLog(nc, run_id)
            first = await log.wait_for(lambda e: isinstance(e, Started), 120, "start")
            assert isinstance(first, Started)
            await log.wait_for(
                lambda e: isinstance(e, Progress) and e.step >= KILL_AT, 120, f"step {KILL_AT}"
            )
            at_signal = time.time()
            stack.signal(first.worker, signal.SIGKILL)
            again = await log.wait_for(
                lambda e: isinstance(e, Started) and e.token > first.token, 120, "next attempt"
            )
            assert isinstance(again, Started)

            def of_next(kind: type[Event]) -> Callable[[Event], bool]:
                return lambda e: (
                    isinstance(e, kind) and getattr(e, "worker", "") == again.worker
                    and e.at >= again.at
                )  # fmt: skip

            restored = await log.wait_for(of_next(Restored), 120, "its restore")
            resumed = await log.wait_for(of_next(Progress), 120, "its first step")
            assert isinstance(restored, Restored) and isinstance(resumed, Progress)
            record = await finished(nc, run_id, timeout=120)
            assert record.state == RunState.COMPLETED, record
            log.close()
            # The killed attempt's process may write a step after the signal: the next
            # attempt's rows are those after its entry point began (step -1).
            rows = torchrun.read_rows(steps)
            starts = [i for i, row in enumerate(rows) if row[1] == -1]
            assert len(starts) == 2, f"{len(starts)} attempts"
            began = starts[-1]
            new = {step: t for t, step, _ in rows[began:]}
            step = min(k for k in new if k > 0)
            assert step == resumed.step, (step, resumed.step)
            phases = {
                "total": resumed.at - at_signal,
                "signal -> next attempt started": again.at - at_signal,
                "  -> its entry point began": new[-1] - again.at,
                "  -> hf.fit called (imports, model, Trainer)": new[0] - new[-1],
                "  -> its first step (finds, downloads, loads the checkpoint, one step)": (
                    new[step] - new[0]
                ),
                "  -> that step's progress event": resumed.at - new[step],
                "signal -> first step's end (as torchrun's total)": new[step] - at_signal,
                "checkpoint found and downloaded (restored's restore_s)": restored.restore_s,
            }
            taker = "the restarted one" if again.worker == first.worker else "the other one"
            return phases, resumed.step, taker
        finally:
            await stack.stop()


def torchrun_kill() -> tuple[Phases, int, str]:
    """torchrun with one restart, its worker SIGKILLed: seconds from the signal to the
    restarted worker's first step (and its parts), and that step."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        args = ["--output-dir", str(Path(tmp) / "out"), "--steps", str(TOTAL)]
        args += ["--save-steps", str(CADENCE), "--pace", str(PACE)]
        phases = torchrun.kill_worker(REPO / "bench" / "hf_torchrun.py", args, KILL_AT, TOTAL)
    step = int(phases.pop("resumed at step"))
    return phases, step, "the agent's new worker"


async def recovery(rounds: int) -> dict[str, list[tuple[Phases, int, str]]]:
    got: dict[str, list[tuple[Phases, int, str]]] = {"baton": [], "torchrun": []}
    for r in range(rounds):
        got["baton"].append(await baton_kill(r))
        got["torchrun"].append(await asyncio.to_thread(torchrun_kill))
    return got


# -- entry point -------------------------------------------------------------------------


def runs(values: list[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="kill rounds of each")
    ap.add_argument("--pairs", type=int, default=10, help="throughput runs of each")
    ap.add_argument("--every", type=int, default=EVERY, help="throughput: steps a checkpoint")
    ap.add_argument("--only", choices=("throughput", "recovery"))
    a = ap.parse_args()
    # As Baton's training process runs a `deterministic = true` job (services/trainer/
    # child.py), and the same for the bare script: one intra-op thread, deterministic kernels.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    print(f"{os.cpu_count()} CPUs; load average before: {os.getloadavg()}", flush=True)
    if a.only in (None, "throughput"):
        got, saves, same = throughput(a.pairs, a.every)
        print(f"1. throughput: {STEPS} steps, a checkpoint every {a.every} (saved at {saves}),"
              f" {a.pairs} pairs of runs (bare, Baton), after steps {WARMUP};"
              f" every step's loss logged, the same in every run: {same}")  # fmt: skip
        for what in got["bare"][0]:
            bare_ = [m[what] for m in got["bare"]]
            baton = [m[what] for m in got["baton"]]
            b, t = statistics.median(bare_), statistics.median(baton)
            each = [y / x if x else 0.0 for x, y in zip(bare_, baton, strict=True)]
            print(f"  {what}: bare {b:.2f} ({runs(bare_)}), Baton {t:.2f} ({runs(baton)})"
                  + (f"; Baton/bare {t / b:.3f} (per pair: {runs(each, '{:.3f}')})" if b else ""),
                  flush=True)  # fmt: skip
    if a.only in (None, "recovery"):
        print(f"load average: {os.getloadavg()}", flush=True)
        kills = asyncio.run(recovery(a.rounds))
        print(f"2. kill -> first resumed step: {TOTAL} steps, a checkpoint every {CADENCE},"
              f" pace {PACE}s, SIGKILL at step >= {KILL_AT}:")  # fmt: skip
        labels = {
            "baton": "Baton, trainer SIGKILLed, supervised",
            "torchrun": "torchrun --max-restarts 1, worker SIGKILLed",
        }
        med: dict[str, float] = {}
        for name, label in labels.items():
            phases = [v[0] for v in kills[name]]
            first = [v[1] for v in kills[name]]
            takers = sorted({v[2] for v in kills[name]})
            for part in phases[0]:
                values = [p[part] for p in phases]
                if part == "total":
                    med[name] = statistics.median(values)
                    print(f"  {label}: median {med[name]:.2f}s (runs: {runs(values)};"
                          f" first resumed step: {first}; run by {', '.join(takers)})")  # fmt: skip
                else:
                    print(f"    {part}: {statistics.median(values):.2f}s ({runs(values)})")
        verdict = "met" if med["baton"] < med["torchrun"] else "NOT met"
        ratio = med["baton"] / med["torchrun"]
        print(f"  Baton / torchrun {ratio:.2f}: goal 'Baton faster' {verdict}")
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
