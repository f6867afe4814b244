"""`baton.runtime.exact`: data parallelism whose result is the same bits at any number of
ranks. Every rank is a real process (`exact_rank.py`) in a real gloo group on loopback;
state goes to and from safetensors files, as a checkpoint would carry it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from baton.runtime.context import RunContext
from baton.runtime.exact import DataParallel
from examples.elastic import train
from shared.contracts import JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, FromChild, Loaded
from tests.baton.harness import RUN, Run
from tests.baton.runtime.exact_rank import Points, build

ROOT = Path(__file__).resolve().parents[3]
SHARDS, BATCH, SAMPLES, STEPS, MID = 6, 4, 100, 12, 6
"""A global batch of 24 out of 100 samples: 4 steps an epoch (4 samples dropped), so 12
steps cross two epoch boundaries, and the switch after step 6 lands mid-epoch."""
SWITCHES = [(2, 3), (3, 1)]
WAIT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_groups(groups: list[tuple[int, dict[str, Any]]], logs: Path) -> None:
    """Start every rank of every group at once, each a process of its own; wait for all
    (bounded); fail with a rank's stderr if any fails. Every process is gone on return.

    A rank 0 that finds its port taken (another process bound it between `free_port` and
    the rank's own bind: the suite runs beside other servers) makes the wave start again
    on fresh ports; nothing of a failed wave is kept."""
    for _ in range(PORT_TRIES):
        failed = _run_wave(groups, logs)
        if failed is None:
            return
        if "EADDRINUSE" not in failed:
            raise AssertionError(failed)
    raise AssertionError(f"every try found a port taken:\n{failed}")


PORT_TRIES = 3


def _run_wave(groups: list[tuple[int, dict[str, Any]]], logs: Path) -> str | None:
    """One start of every rank of `groups`: None if all succeeded, else a failing rank's
    stderr."""
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for g, (world, cfg) in enumerate(groups):
            port = free_port()
            for rank in range(world):
                log = logs / f"group{g}-rank{rank}.err"
                arg = json.dumps({**cfg, "rank": rank, "world": world, "port": port})
                with log.open("wb") as stderr:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "tests.baton.runtime.exact_rank", arg],
                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                    )  # fmt: skip
                procs.append((str(log), proc))
        deadline = time.monotonic() + WAIT_S
        for err, proc in procs:
            rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if rc != 0:
                return f"{err}: exit {rc}\n{Path(err).read_text()[-3000:]}"
        return None
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def run_cfg(out: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "shards": SHARDS, "batch": BATCH, "samples": SAMPLES, "steps": STEPS, "seed": 3,
        "save": str(out / f"{name}-{{rank}}.safetensors"),
        "record": str(out / f"{name}-{{rank}}.json"),
        **extra,
    }  # fmt: skip


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run of the module, in two waves of concurrent groups: 12 steps at 1, 2 and 3
    ranks (each keeping its state after step 6); then from those states the last 6 steps at
    another size: 2 -> 3 (grown) and 3 -> 1 (shrunk)."""
    d = tmp_path_factory.mktemp("exact")
    first = [
        (w, run_cfg(d, f"w{w}", mid=MID, mid_save=str(d / f"w{w}-mid-{{rank}}.safetensors")))
        for w in (1, 2, 3)
    ]
    run_groups(first, d)
    second = [
        (after, run_cfg(d, f"w{before}to{after}", start=MID,
                        load=str(d / f"w{before}-mid-0.safetensors")))
        for before, after in SWITCHES
    ]  # fmt: skip
    run_groups(second, d)
    return d


def read(path: Path) -> tuple[dict[str, bytes], str]:
    """A state file's tensors, as raw bytes (bitwise comparison, -0.0 and NaN included),
    and its JSON metadata."""
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}  # noqa: SIM118
        return tensors, f.metadata()["json"]


def differences(a: Path, b: Path) -> list[str]:
    (ta, ma), (tb, mb) = read(a), read(b)
    diff = sorted(k for k in ta.keys() | tb.keys() if ta.get(k) != tb.get(k))
    return diff + (["metadata"] if ma != mb else [])


def records(out: Path, name: str, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-{r}.json").read_text()) for r in range(world)]


def test_the_weights_and_optimizer_state_are_the_same_bits_at_1_2_and_3_ranks(out: Path) -> None:
    reference = out / "w1-0.safetensors"
    tensors, _ = read(reference)
    assert any(k.startswith("opt.") and k.endswith("exp_avg_sq") for k in tensors), tensors.keys()
    for world in (2, 3):
        for rank in range(world):
            other = out / f"w{world}-{rank}.safetensors"
            diff = differences(reference, other)
            assert not diff, f"{world} ranks, rank {rank}: differs from 1 rank in {diff}"
    # Training moved the weights: the equality is not that of untouched initial values.
    model, _, _ = build(3, STEPS)
    initial = model.state_dict()["0.weight"].numpy().tobytes()
    assert tensors["model.0.weight"] != initial, "12 steps left the first layer unchanged"


def test_every_rank_reports_the_same_loss_at_every_size(out: Path) -> None:
    losses = [r["losses"] for w in (1, 2, 3) for r in records(out, f"w{w}", w)]
    assert len(losses[0]) == STEPS, losses[0]
    assert all(each == losses[0] for each in losses), losses


@pytest.mark.parametrize("before,after", SWITCHES)
def test_a_run_that_changes_size_midway_ends_as_the_uninterrupted_run(
    out: Path, before: int, after: int
) -> None:
    uninterrupted = out / "w1-0.safetensors"
    for rank in range(after):
        resumed = out / f"w{before}to{after}-{rank}.safetensors"
        diff = differences(uninterrupted, resumed)
        assert not diff, f"{before} -> {after} ranks, rank {rank}: differs in {diff}"
    full = records(out, "w1", 1)[0]["losses"]
    assert records(out, f"w{before}to{after}", after)[0]["losses"] == full[MID:]


def test_every_sample_of_an_epoch_is_used_once_whoever_computes_it(out: Path) -> None:
    per_step = SAMPLES // (SHARDS * BATCH)
    by_world: dict[int, dict[str, list[int]]] = {}
    for world in (1, 2, 3):
        seen: dict[str, list[int]] = {}
        for rank, rec in enumerate(records(out, f"w{world}", world)):
            mine = {int(k.split("/")[1]) for k in rec["seen"]}
            assert mine == set(range(rank * SHARDS // world, (rank + 1) * SHARDS // world))
            assert not seen.keys() & rec["seen"].keys(), "two ranks computed one shard"
            seen.update(rec["seen"])
        assert len(seen) == STEPS * SHARDS, sorted(seen)
        by_world[world] = seen
    assert by_world[1] == by_world[2] == by_world[3], "the shards' samples depend on the size"
    for epoch in range(STEPS // per_step):
        used = [
            i
            for step in range(epoch * per_step, (epoch + 1) * per_step)
            for shard in range(SHARDS)
            for i in by_world[1][f"{step}/{shard}"]
        ]
        assert len(used) == len(set(used)) == per_step * SHARDS * BATCH, (epoch, sorted(used))
        assert set(used) <= set(range(SAMPLES))
    epochs = [{i for s in range(e * per_step, (e + 1) * per_step) for i in by_world[1][f"{s}/0"]}
              for e in range(2)]  # fmt: skip
    assert epochs[0] != epochs[1], "every epoch in the same order"


def test_the_callers_global_rng_is_left_as_it_was(out: Path) -> None:
    for world in (1, 2, 3):
        assert all(r["rng_kept"] for r in records(out, f"w{world}", world)), world


# -- in this process, one rank ---------------------------------------------------------


def helper(**kw: Any) -> tuple[nn.Module, DataParallel]:
    model, _, _ = build(3, STEPS)
    opts: dict[str, Any] = {"batch_size": BATCH, "shards": SHARDS, "seed": 3, **kw}
    return model, DataParallel(model, Points(3, SAMPLES), **opts)


def one_step(model: nn.Module, dp: DataParallel, step: int) -> Iterator[torch.Tensor]:
    """One step; yields what each shard's body drew from the global RNG."""
    for shard in dp.shards(step):
        yield torch.rand(3)
        x, y, _ = shard.batch
        shard.backward(nn.functional.cross_entropy(model(x), y))


def test_a_shards_body_draws_the_same_numbers_whatever_the_callers_rng() -> None:
    model, dp = helper()
    drawn = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        drawn.append(torch.stack(list(one_step(model, dp, 5))))
        dp.sync()
        assert torch.equal(torch.get_rng_state(), state), "the shards moved the caller's RNG"
    assert torch.equal(drawn[0], drawn[1])
    assert len({tuple(d.tolist()) for d in drawn[0]}) == SHARDS, "shards share an RNG stream"


def test_fewer_shards_than_ranks_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="shards=2 is fewer than the 3 ranks"):
        helper(shards=2, rank=0, world_size=3)


def test_a_dataset_shorter_than_a_global_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="less than one global batch"):
        helper(shards=30)


def test_sync_before_every_shard_had_its_backward_is_refused() -> None:
    model, dp = helper()
    for shard in dp.shards(0):
        if shard.index < 3:
            x, y, _ = shard.batch
            shard.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=r"before shards \[3, 4, 5\]"):
        dp.sync()
    with pytest.raises(RuntimeError, match="before shards"):
        dp.sync()  # still refused: nothing was gathered


def test_sync_puts_the_mean_of_the_shards_gradients_in_grad() -> None:
    model, dp = helper()
    model.eval()  # no dropout: the gradients can be computed again here
    list(one_step(model, dp, 2))
    loss = dp.sync()
    got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    want = [torch.zeros_like(p) for p in model.parameters()]
    losses = []
    for shard in range(SHARDS):
        x, y, _ = torch.utils.data.default_collate([dp.dataset[i] for i in dp.indices(2, shard)])
        model.zero_grad()
        each = nn.functional.cross_entropy(model(x), y)
        each.backward()  # type: ignore[no-untyped-call]
        losses.append(each.item())
        for i, p in enumerate(model.parameters()):
            assert p.grad is not None
            want[i] = want[i] + p.grad
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w / SHARDS, atol=1e-6), (g, w / SHARDS)
    assert abs(loss - sum(losses) / SHARDS) < 1e-6, (loss, losses)


# -- the example job, through the run's context ----------------------------------------


class Dies(RunContext):
    """A run's context whose attempt 'dies' after `until` steps: it hands out no more, and
    takes no checkpoint after the last step it ran (as `tests.baton.harness` does)."""

    until: int | None = None

    def steps(self) -> Iterator[int]:
        for step in super().steps():
            yield step
            if self.until is not None and step + 1 >= self.until:
                return


def test_the_example_resumes_exactly_through_the_run_context(tmp_path: Path) -> None:
    job = convert(
        {
            "name": "elastic", "entry_point": "examples.elastic:train", "total_steps": 10,
            "deterministic": True, "seed": 4, "ranks": {"min": 1, "max": 3},
            "checkpoint": {"every_steps": 2},
            "config": {"samples": 256, "batch": 8, "hidden": 16},
        },
        JobSpec,
    )  # fmt: skip
    digests, resumed_at = [], []
    for name, attempts in (("whole", [None]), ("killed", [7, None])):
        run = Run(tmp_path / name, job)
        for until in attempts:
            run.token += 1
            sent: list[FromChild] = []
            ctx = Dies(Task(run_id=RUN, spec=job), run.token, run.store_url,
                       run.root / "spool", sent.append)  # fmt: skip
            ctx.until = until
            try:
                train(ctx)
            finally:
                ctx.close()
            readies = [m for m in sent if isinstance(m, CheckpointReady)]
            for ready in readies:
                run.commit(ready)
            resumed_at += [m.step for m in sent if isinstance(m, Loaded)]
            if until is not None:  # periodic ones: every 2 steps, unless a write was busy
                assert readies and not readies[-1].final and readies[-1].step < until, readies
            else:
                assert readies[-1].final and readies[-1].step == 10, readies[-1]
                digests.append(readies[-1].digest)
    assert resumed_at[0] == 0 and resumed_at[1] == 0 and 0 < resumed_at[2] < 7, resumed_at
    assert digests[0] == digests[1], digests
