"""Elastic runs, end to end: `examples/elastic.py` with `ranks = {min = 1, max = 2}` on real
trainers (gloo on CPU) that are SIGKILLed for good, added, and SIGSTOPped.

One stack for the module, lease TTL 3 s, trainers that stay dead when killed. The run
shrinks to one rank when it loses one and no spare is free, leaves a newly free trainer to a
queued run before it grows back onto it, and ends on the same bits as uninterrupted runs at
one and at two ranks; a stale leader from before a resize is fenced and its commit refused.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import calls as client
from services.trainer.forming import FORM_GRACE_S
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Diverged,
    GroupFormed,
    Preempted,
    Progress,
    RankLost,
    Resized,
    Restored,
    Started,
)
from shared.state.runs import Runs
from tests.e2e.jobs import EventLog, fenced_and_refused, finished, history, job, submit
from tests.support.stack import Stack, alive, attempt_processes, eventually, named_trainers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

RANGE = {"min": 1, "max": 2}


def elastic(key: str, *, total: int = 300, ranks: Any = RANGE, **config: Any) -> JobSpec:
    """Two virtual shards whatever the size: the arithmetic of every run here is the same."""
    return job(
        name="elastic",
        entry_point="examples.elastic:train",
        total_steps=total,
        ranks=ranks,
        seed=5,
        checkpoint={"every_steps": 10},
        config={"shards": 2, "samples": 512, "steps_sleep": 0.03, **config},
        idempotency_key=key,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("elastic"), ("e1", "e2")) as s:
        yield s


_reference: dict[str, str] = {}


async def reference(nc: Client, ranks: int) -> str:
    """The weights of the uninterrupted run at a fixed size (the pace changes no arithmetic)."""
    key = f"reference-{ranks}"
    if key not in _reference:
        run_id = await submit(nc, elastic(key, ranks=ranks, steps_sleep=0.0))
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED and record.digest, record.reason
        _reference[key] = record.digest
    return _reference[key]


async def test_a_run_shrinks_grows_back_and_ends_as_at_one_and_at_two_ranks(pool: Stack) -> None:
    nc = await pool.client()
    at_one, at_two = await reference(nc, 1), await reference(nc, 2)
    assert at_one == at_two, "the exact helper gave other bits at another size"
    run_id = await submit(nc, elastic("shrink-grow"))
    log = EventLog(nc, run_id)
    # Both trainers are idle, but on a loaded machine the second may take the call after
    # the forming grace: the group then forms at one rank and grows onto it at once.
    first = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and len(e.members) == 2, 90, "a group of two"
    )
    assert isinstance(first, GroupFormed)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.token == first.epoch, 60, "commit"
    )

    # Rank 1's trainer dies for good, and no spare is free: the run goes on at one rank.
    pool.signal(first.members[1], signal.SIGKILL)
    lost = await log.wait_for(lambda e: isinstance(e, RankLost), 30, "the rank's loss")
    shrunk = await log.wait_for(
        lambda e: isinstance(e, Resized) and e.epoch > first.epoch, 60, "the shrink"
    )
    assert isinstance(lost, RankLost) and isinstance(shrunk, Resized)
    assert (shrunk.from_ranks, shrunk.to_ranks) == (2, 1) and "no spare" in shrunk.reason
    committed = {e.step for e in log.of(CheckpointCommitted)}
    assert shrunk.step in committed and shrunk.step <= lost.step  # from the last commit
    await log.wait_for(
        lambda e: isinstance(e, Progress) and e.step > shrunk.step + 5, 60, "one rank training"
    )

    # A queued run and a free trainer: the queued run gets the trainer first. The one rank
    # left is held (SIGSTOP) until the new trainer, done with that run, holds the offer to
    # grow, so that the run cannot reach its end first however slow the machine is: the
    # group grows at the rank's next step boundary once it goes on.
    held = attempt_processes(pool.pid(first.members[0]))
    assert held, "the surviving rank has no training process"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        other = await submit(nc, job(entry_point="tests.support.workloads:paced", total_steps=40))
        await pool.add_trainer("e3")
        done = await finished(nc, other, timeout=90)
        assert done.state is RunState.COMPLETED and done.worker is None

        async def offer_held() -> bool:
            return "offered to grow its group" in pool.log("e3")

        await eventually(offer_held, 60, "the new trainer to hold the offer to grow")
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    (started,) = [e for e in await history(nc, other) if isinstance(e, Started)]
    grown = await log.wait_for(
        lambda e: isinstance(e, Resized) and e.to_ranks == 2 and e.epoch > shrunk.epoch,
        60,
        "the run to grow back",
    )
    assert isinstance(grown, Resized) and grown.from_ranks == 1 and "free" in grown.reason
    assert started.at < grown.at, "the run grew before the queued run was served"
    assert "left for other work" in pool.log("e3"), "the free trainer did not yield first"
    stop = [e for e in log.of(Preempted) if e.reason]
    assert stop and "grow" in stop[-1].reason and stop[-1].step == grown.step

    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == at_one == at_two
    assert record.retries == 0 and record.group_size == 2
    # Every resume, at either size, replayed the steps after its checkpoint to the same
    # metrics the earlier attempt reported (the deterministic run's own witness).
    assert not log.of(Diverged) and record.spec.deterministic
    # Every group resumed from a committed step.
    committed = {e.step for e in log.of(CheckpointCommitted)} | {0}
    assert all(r.step in committed for r in log.of(Restored))
    log.close()


async def test_a_stale_leader_from_before_a_resize_is_fenced_and_cannot_commit(
    pool: Stack,
) -> None:
    nc = await pool.client()
    want = await reference(nc, 1)
    run_id = await submit(nc, elastic("stale-leader"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and len(e.members) == 2, 60, "a group of two"
    )
    assert isinstance(first, GroupFormed)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.token == first.epoch, 60, "commit"
    )
    zombie = first.members[0]
    pid = pool.pid(zombie)
    family = attempt_processes(pid)
    os.kill(pid, signal.SIGSTOP)  # past the TTL: its lease lapses, its group is over
    try:
        shrunk = await log.wait_for(
            lambda e: isinstance(e, Resized) and e.epoch > first.epoch, 60, "a group of one"
        )
        assert isinstance(shrunk, Resized) and shrunk.to_ranks == 1 and shrunk.worker != zombie
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.token == shrunk.epoch,
            60,
            "the new group's commit",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    await fenced_and_refused(log, pool.store_url, zombie, first.epoch, family, ranks=1)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.digest == want
    log.close()


async def test_a_run_below_its_min_waits_says_why_and_never_trains(pool: Stack) -> None:
    """Two idle trainers, a run that needs at least three: it waits past the forming grace
    and says why, with no attempt and no training process; cancelled, it ends at once."""
    nc = await pool.client()
    idle = [w for w in ("e1", "e2", "e3") if _alive(pool, w)]
    assert len(idle) == 2, idle
    run_id = await submit(nc, elastic("below-min", ranks={"min": 3, "max": 4}))
    runs = await Runs.open(nc.jetstream())

    async def waiting() -> str | None:
        found = await runs.get(run_id)
        return found[0].waiting if found else None

    # The scheduler admits no run its pool has not the trainers for, and says so.
    why = await eventually(waiting, 30, "the run to say why it waits")
    assert "needs 3 trainers at once" in why and "has 2 live" in why, why
    # Not a synchronisation: the window in which a group that ignored its min would form.
    await asyncio.sleep(2 * FORM_GRACE_S)
    found = await runs.get(run_id)
    assert found is not None and found[0].state is RunState.QUEUED and found[0].attempts == 0
    assert not any(attempt_processes(pool.pid(w)) for w in idle)
    assert not [e for e in await history(nc, run_id) if isinstance(e, Started | GroupFormed)]
    await client.cancel(nc, run_id, "not enough trainers")
    assert (await finished(nc, run_id, timeout=60)).state is RunState.CANCELLED


def _alive(stack: Stack, name: str) -> bool:
    try:
        return alive(stack.pid(name))
    except (KeyError, AssertionError):  # never started, or dead and not restarted
        return False
