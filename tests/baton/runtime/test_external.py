"""A loop Baton does not own (`baton.runtime.external`), written here as a framework would
write one: its own optimizer step, its own data order, its own checkpoint files (safetensors
and JSON, in a fresh directory per save). The real RunContext and writer, the real commit
protocol on a file store; attempts that die mid-run and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.runtime.context import RunContext
from baton.runtime.external import ExternalLoop
from shared.checkpoint.digest import weights_digest
from shared.contracts import JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, FromChild, Loaded
from shared.errors import IntegrityError
from tests.baton.harness import RUN, Attempt, Run, spec

TOTAL, EVERY = 12, 5


class Framework:
    """A tiny framework: a model, an optimizer, a seeded data order it tracks itself, and a
    `save`/`load` of its own files."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.data = torch.Generator().manual_seed(3)

    def step(self) -> float:
        x = torch.randn(16, 4, generator=self.data)
        loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        save_file(self.model.state_dict(), str(directory / "model.safetensors"))
        opt = self.opt.state_dict()
        tensors = {f"{k}.{n}": v for k, s in opt["state"].items() for n, v in s.items()}
        save_file(tensors, str(directory / "optimizer.safetensors"))
        save_file({"data": self.data.get_state()}, str(directory / "data.safetensors"))
        (directory / "state.json").write_text(json.dumps({"groups": opt["param_groups"]}))

    def load(self, directory: Path) -> None:
        self.model.load_state_dict(load_file(str(directory / "model.safetensors")))
        tensors = load_file(str(directory / "optimizer.safetensors"))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in tensors.items():
            k, n = key.split(".", 1)
            state.setdefault(int(k), {})[n] = v
        groups = json.loads((directory / "state.json").read_text())["groups"]
        self.opt.load_state_dict({"state": state, "param_groups": groups})
        self.data.set_state(load_file(str(directory / "data.safetensors"))["data"])


def attempt(run: Run, until: int | None = None, commit: bool = True) -> tuple[Attempt, str]:
    """One attempt of the framework's loop under Baton; it 'dies' after step `until`."""
    run.token += 1
    sent: list[FromChild] = []
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), run.token, run.store_url, run.root / "spool", sent.append
    )
    loop = ExternalLoop(ctx)
    fw = Framework()
    resume = loop.resume()
    if resume is not None:
        fw.load(resume)
    step = ctx.step
    try:
        while step < TOTAL:
            loss = fw.step()
            step += 1
            at = loop.step_ended(step, loss=loss)
            if at.save:
                where = run.root / "out" / f"t{run.token}-{step}"
                fw.save(where)
                loop.saved(step, where, weights=fw.model.state_dict())
            if at.stop or (until is not None and step >= until):
                break
    finally:
        ctx.close()
    done = Attempt(ctx, sent)
    if commit:
        for ready in done.checkpoints():
            run.commit(ready)
    return done, weights_digest(fw.model.state_dict())


def test_a_frameworks_loop_resumes_from_its_own_files_bit_for_bit(tmp_path: Path) -> None:
    """Killed after step 9 (its last commit at 5; the three steps after it are its
    witness), resumed: the same weights as a run that never stopped, the framework's files
    handed back under their own names, and the self-check finds the resumed steps equal to
    the first attempt's."""
    whole = Run(tmp_path / "whole", spec(total=TOTAL, every=EVERY))
    done, want = attempt(whole)
    ready = done.checkpoints()
    # Step 10's may be postponed while step 5's is still being written
    # (`baton.runtime.snapshot`).
    assert ready[0].step == 5 and ready[-1].step == 12 and ready[-1].final
    assert ready[-1].digest == want
    names = {f.name for f in ready[0].files}
    assert names == {"meta.json", "rng.safetensors", "file.model.safetensors",
                     "file.optimizer.safetensors", "file.data.safetensors",
                     "file.state.json"}  # fmt: skip

    run = Run(tmp_path / "cut", spec(total=TOTAL, every=EVERY))
    first, _ = attempt(run, until=9)
    assert [r.step for r in first.checkpoints()] == [5]
    second, got = attempt(run)
    loaded = [m for m in second.sent if isinstance(m, Loaded)]
    assert [m.step for m in loaded] == [5]
    assert got == want and second.checkpoints()[-1].digest == want
    assert not second.divergences()
    resumed = tmp_path / "cut" / "spool" / "resume"
    assert sorted(p.name for p in resumed.iterdir()) == [
        "data.safetensors", "model.safetensors", "optimizer.safetensors", "state.json"
    ]  # fmt: skip


def test_a_difference_the_checkpoint_does_not_hold_is_reported_as_a_divergence(
    tmp_path: Path,
) -> None:
    """The data order is not put back (the framework forgets its generator): the resumed
    steps' losses differ from the first attempt's, and the self-check says so."""
    run = Run(tmp_path, spec(total=TOTAL, every=EVERY))
    attempt(run, until=9)
    original = Framework.load

    def forgetful(self: Framework, directory: Path) -> None:
        original(self, directory)
        self.data.manual_seed(99)

    Framework.load = forgetful  # type: ignore[method-assign]
    try:
        second, _ = attempt(run)
    finally:
        Framework.load = original  # type: ignore[method-assign]
    (diverged,) = second.divergences()
    assert (diverged.checkpoint, diverged.step, diverged.metric) == (5, 6, "loss")


def test_preemption_saves_the_step_it_stops_at(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=TOTAL, every=100))
    run.token += 1
    sent: list[FromChild] = []
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), run.token, run.store_url, tmp_path / "spool", sent.append
    )
    loop = ExternalLoop(ctx)
    assert loop.resume() is None
    fw = Framework()
    for step in range(1, 4):
        fw.step()
        if step == 3:
            ctx.request("stop")
        at = loop.step_ended(step)
        assert (at.save, at.stop) == (step == 3, step == 3)
    fw.save(tmp_path / "out")
    loop.saved(3, tmp_path / "out", weights=fw.model.state_dict())
    ctx.close()
    (ready,) = [m for m in sent if isinstance(m, CheckpointReady)]
    assert ready.step == 3 and not ready.final and ctx.finished_early


def test_misuse_is_refused_with_what_to_do(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=TOTAL, every=EVERY))

    def context(job: JobSpec | None = None) -> RunContext:
        task = Task(run_id=RUN, spec=job or run.job)
        return RunContext(task, 1, run.store_url, tmp_path / "spool", lambda m: None)

    elastic = convert({"name": "e", "entry_point": "m:f", "total_steps": 4,
                       "ranks": {"min": 1, "max": 2}}, JobSpec)  # fmt: skip
    with pytest.raises(ValueError, match="elastic"):
        ExternalLoop(context(elastic))
    ctx = context()
    ctx.restore(model=torch.nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match="restore"):
        ExternalLoop(ctx)
    ctx.close()

    ctx = context()
    loop = ExternalLoop(ctx)
    with pytest.raises(RuntimeError, match="resume"):
        loop.step_ended(1)
    loop.resume()
    with pytest.raises(ValueError, match="one call per step"):
        loop.step_ended(2)
    loop.step_ended(1)
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match="plain files only"):
        loop.saved(1, nested, weights={})
    with pytest.raises(ValueError, match="the step just ended"):
        loop.saved(2, nested, weights={})
    ctx.close()


def test_a_checkpoint_of_baton_s_own_loop_is_not_taken_for_a_frameworks(tmp_path: Path) -> None:
    run = Run(tmp_path, spec(total=TOTAL, every=EVERY))

    def setup(ctx: RunContext):  # type: ignore[no-untyped-def]
        ctx.restore(model=torch.nn.Linear(1, 1))
        return lambda step: None

    run.attempt(setup, until=7)
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), 9, run.store_url, tmp_path / "spool2", lambda m: None
    )
    with pytest.raises(IntegrityError, match=r"resume it with ctx\.restore"):
        ExternalLoop(ctx).resume()
    ctx.close()
