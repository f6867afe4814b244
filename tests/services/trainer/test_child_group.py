"""A run of two ranks, as real training processes forked by a real zygote, on gloo: they
stop together and resume exactly, one commit holding both ranks' files; a rank that is
killed, or whose code raises, ends its peer with the right exit status.

The test plays both trainers (launching rank 0, then rank 1 on the port rank 0 reports) and
the checkpointer (committing rank 0's `CheckpointReady` messages with the real protocol).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from services.trainer.child_proc import Zygote
from shared.checkpoint import commit
from shared.contracts import JobSpec, convert
from shared.contracts.child import (
    EXIT_GROUP_BROKEN,
    EXIT_USER_ERROR,
    CheckpointReady,
    Control,
    Finished,
    Listening,
    StepDone,
)
from tests.support.child_group import Group, Rank, zygote

__all__ = ["zygote"]  # the fixture, used by name


def job(total: int, timeout_s: float = 20, **config: Any) -> JobSpec:
    return convert(
        {
            "name": "ddp",
            "entry_point": "examples.ddp:train",
            "total_steps": total,
            "deterministic": True,
            "seed": 7,
            "ranks": 2,
            "collective_timeout_s": timeout_s,
            "checkpoint": {"every_steps": 25},
            "config": config,
        },
        JobSpec,
    )


async def test_two_ranks_stop_together_and_resume_exactly(tmp_path: Path, zygote: Zygote) -> None:
    """An uninterrupted run, and one whose rank 1 alone is told to stop mid-run and that a
    new group (a higher epoch) resumes: both ranks stop at the same step, rank 0's one
    checkpoint lists both ranks' files, and the final weights are the same bit for bit."""
    spec = job(60, steps_sleep=0.01)
    whole = Group(tmp_path / "whole", zygote, "ddp-whole", spec)
    ranks = await whole.start()
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    assert not ranks[1].of(CheckpointReady), "only rank 0 sends checkpoints"
    await whole.commit(ranks[0])
    reference = ranks[0].of(CheckpointReady)[-1]
    assert reference.final and reference.step == 60

    run = Group(tmp_path / "run", zygote, "ddp-run", spec)
    ranks = await run.start()
    await ranks[1].until(StepDone, lambda m: m.step >= 10)
    ranks[1].child.send(Control(action="stop"))
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    stopped = [r.of(Finished)[-1] for r in ranks]
    assert all(f.stopped for f in stopped) and stopped[0].step == stopped[1].step < 60, stopped
    last = ranks[0].of(CheckpointReady)[-1]
    assert last.step == stopped[0].step and not last.final
    names = {f.name for f in last.files}
    assert {"meta.json", "rng.safetensors", "model.safetensors", "data.safetensors"} <= names
    assert {"rank1.meta.json", "rank1.rng.safetensors", "rank1.data.safetensors"} <= names
    assert not any(n.startswith("rank1.model") or n.startswith("rank1.opt") for n in names)
    await run.commit(ranks[0])

    ranks = await run.start()
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    resumed = ranks[0].of(CheckpointReady)[-1]
    assert resumed.token == 2 and resumed.final and resumed.step == 60
    assert resumed.digest == reference.digest, "the resumed run's weights differ"
    assert resumed.metrics == reference.metrics, (resumed.metrics, reference.metrics)
    await run.commit(ranks[0])
    latest = await commit.read_latest(run.store, "ddp-run")
    assert latest is not None and latest[0].final


@pytest.mark.parametrize("victim", [0, 1])
async def test_a_killed_rank_breaks_the_group(tmp_path: Path, zygote: Zygote, victim: int) -> None:
    """SIGKILL one rank mid-run (the store's host, rank 0, or rank 1): its peer's next
    collective fails at once (gloo: the connection is closed), and the peer exits as a
    broken group, not as a user error. Bounded by WAIT_S, far below the 20 s collective
    timeout a hang would wait for."""
    group = Group(tmp_path, zygote, "ddp-kill", job(100_000, steps_sleep=0.01))
    ranks = await group.start()
    await ranks[victim].until(StepDone, lambda m: m.step >= 5)
    ranks[victim].child.kill()
    survivor = ranks[1 - victim]
    assert await survivor.exit_code() == EXIT_GROUP_BROKEN, survivor.output()
    assert await ranks[victim].exit_code() == -signal.SIGKILL
    assert "gloo" in survivor.output(), survivor.output()  # the traceback is in the log
    assert not survivor.of(Finished)


async def test_a_rank_that_hangs_or_never_comes_breaks_the_group_after_the_timeout(
    tmp_path: Path, zygote: Zygote
) -> None:
    """A peer that lives but takes no part (SIGSTOPped): the survivor's collective times out
    after `collective_timeout_s` and it exits as a broken group — by `os._exit`, since
    gloo's teardown would abort it (SIGABRT) after a timed-out operation. A peer that never
    joins: the group's set-up times out the same way."""
    group = Group(tmp_path, zygote, "ddp-hang", job(100_000, timeout_s=1.5, steps_sleep=0.01))
    ranks = await group.start()
    await ranks[1].until(StepDone, lambda m: m.step >= 2)
    os.kill(ranks[1].child.pid, signal.SIGSTOP)
    try:
        assert await ranks[0].exit_code() == EXIT_GROUP_BROKEN, ranks[0].output()
        assert "Timed out" in ranks[0].output(), ranks[0].output()
    finally:
        ranks[1].child.kill()
    await ranks[1].exit_code()

    alone = Rank(await zygote.fork(), tmp_path / "alone.log")
    alone.child.send(group._launch(0, 0))
    await alone.until(Listening)
    assert await alone.exit_code() == EXIT_GROUP_BROKEN, alone.output()
    assert "DistStoreError" in alone.output(), alone.output()


async def test_a_user_error_in_one_rank_fails_it_and_breaks_its_peer(
    tmp_path: Path, zygote: Zygote
) -> None:
    """Rank 1's code raises at step 5: rank 1 exits as a user error with its traceback in
    its log; rank 0, left waiting in a collective, exits as a broken group — the user's
    failure is rank 1's, and rank 0's status must not count it a second time."""
    group = Group(tmp_path, zygote, "ddp-fail", job(1000, fail_rank=1, fail_at=5))
    ranks = await group.start()
    codes = [await r.exit_code() for r in ranks]
    assert codes == [EXIT_GROUP_BROKEN, EXIT_USER_ERROR], [codes, *[r.output() for r in ranks]]
    out = ranks[1].output()
    assert "Traceback" in out and "ValueError: rank 1 fails at step 5, as configured" in out, out
    assert all(not r.of(Finished) for r in ranks)
    assert max(m.step for m in ranks[0].of(StepDone)) <= 5


async def test_an_elastic_checkpoint_of_two_ranks_restores_at_one_and_at_three(
    tmp_path: Path, zygote: Zygote
) -> None:
    """An elastic run (`ranks = {min = 1, max = 3}`) stopped at 2 ranks commits rank 0's
    state alone; resumed from that one commit by 1 rank and by 3, every rank holds the
    weights and optimizer state both ranks held when they stopped, bit for bit, and the two
    continuations end on the same weights."""
    dump = tmp_path / "dump"
    dump.mkdir()
    spec = convert(
        {
            "name": "elastic", "entry_point": "tests.support.workloads:elastic_probe",
            "total_steps": 40, "deterministic": True, "seed": 3,
            "ranks": {"min": 1, "max": 3}, "collective_timeout_s": 20,
            "checkpoint": {"every_steps": 1000},
            "config": {"shards": 3, "dump": str(dump), "pace": 0.01},
        },
        JobSpec,
    )  # fmt: skip
    run = Group(tmp_path / "two", zygote, "elastic", spec)
    ranks = await run.start(2)
    await ranks[1].until(StepDone, lambda m: m.step >= 8)
    ranks[0].child.send(Control(action="stop"))
    assert [await r.exit_code() for r in ranks] == [0, 0], [r.output() for r in ranks]
    (ready,) = ranks[0].of(CheckpointReady)
    assert not any(f.name.startswith("rank1.") for f in ready.files)  # rank 0's state alone
    await run.commit(ranks[0])
    stopped = [load_file(dump / f"1-stopped-rank{k}.safetensors") for k in range(2)]
    assert_same(stopped[0], stopped[1])

    copies = []
    for size in (1, 3):
        copy = Group(tmp_path / f"at{size}", zygote, "elastic", spec)
        copy.store, copy.epoch = run.store, run.epoch  # resumes the same commit
        ranks = await copy.start(size)
        assert [await r.exit_code() for r in ranks] == [0] * size, [r.output() for r in ranks]
        for k in range(size):
            assert_same(load_file(dump / f"{copy.epoch}-restored-rank{k}.safetensors"), stopped[0])
        final = ranks[0].of(CheckpointReady)[-1]
        assert final.final and final.step == 40
        copies.append(final.digest)
        run.epoch = copy.epoch
    assert copies[0] == copies[1], "the continuations at 1 and 3 ranks differ"


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
