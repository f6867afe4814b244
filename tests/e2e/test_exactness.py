"""A run checks itself: a job whose resume is not exact (an unregistered generator drives
its dropout) is flagged by a `diverged` event right after it resumes, shown by `baton
status`, `logs` and `report`; the same kill of an exact job is not flagged."""

from __future__ import annotations

import os
import signal

from baton.cli import client
from baton.cli.watch import describe
from shared.contracts import JobSpec, RunState
from shared.contracts.events import CheckpointCommitted, Diverged, Progress, Restored, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack, alive, children_of, eventually

STEPS, EVERY = 80, 10


def spec(entry: str, key: str) -> JobSpec:
    return job(
        entry_point=entry, total_steps=STEPS, checkpoint={"every_steps": EVERY},
        config={"pace": 0.03}, seed=5, idempotency_key=key,
    )  # fmt: skip


async def kill_after_a_commit(stack: Stack, log: EventLog) -> Started:
    """SIGKILL the trainer of the run once a checkpoint is committed and the run is a few
    steps past it, so the next attempt resumes from a checkpoint with a witness."""
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
    assert isinstance(first, Started)
    done = await log.wait_for(lambda e: isinstance(e, CheckpointCommitted), 30, "a commit")
    assert isinstance(done, CheckpointCommitted)
    await log.wait_for(
        lambda e: isinstance(e, Progress) and e.step >= done.step + 5, 30, "steps past it"
    )
    victim = stack.pid(first.worker)
    family = children_of(victim)
    os.kill(victim, signal.SIGKILL)

    async def gone() -> bool:
        return not any(alive(p) for p in family)

    await eventually(gone, 10, "the killed trainer's family")
    return first


async def test_a_resume_that_is_not_exact_is_flagged_and_an_exact_one_is_not(two: Stack) -> None:
    nc = await two.client()
    loose = await submit(nc, spec("tests.support.workloads:unregistered_generator", "loose"))
    log = EventLog(nc, loose)
    await kill_after_a_commit(two, log)
    await two.add_trainer("spare-1")
    flagged = await log.wait_for(lambda e: isinstance(e, Diverged), 60, "a diverged event")
    assert isinstance(flagged, Diverged)
    resumed = log.of(Restored)[-1]
    assert resumed.step > 0 and flagged.checkpoint == resumed.step, (resumed, flagged)
    assert resumed.step < flagged.step <= resumed.step + 3, "not within the first steps"
    assert flagged.metric == "loss" and float(flagged.expected) != float(flagged.got)
    assert (await finished(nc, loose)).state is RunState.COMPLETED  # flagged, not stopped
    assert len(log.of(Diverged)) == 1, "one report per resume"
    shown = await client.divergences(nc, loose)
    assert shown == [flagged], shown
    line = describe(flagged)
    assert line is not None and f"step {flagged.step}" in line and flagged.got in line, line
    log.close()

    exact = await submit(nc, spec("tests.support.workloads:paced", "exact"))
    log = EventLog(nc, exact)
    await kill_after_a_commit(two, log)
    await two.add_trainer("spare-2")
    record = await finished(nc, exact)
    assert record.state is RunState.COMPLETED
    assert log.of(Restored)[-1].step > 0, "the exact job did not resume from a checkpoint"
    assert not log.of(Diverged) and not await client.divergences(nc, exact)
    log.close()
