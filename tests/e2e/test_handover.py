"""A dead trainer's run is handed over at once when its death is certain, and when its lease
expires when it is not — never after the AckWait; and a run killed once accounts its goodput.

These are the paths that stand when the reaper hears neither pulses nor departures
(`BATON_SILENT_AFTER=0`, as for a trainer at a site, which sends none): its successor on
the same host, and the lease's expiry. With them on, a death is seen sooner
(tests/e2e/test_failures.py, tests/e2e/test_cluster.py)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import pytest

from shared.contracts import RunState
from shared.contracts.events import (
    CheckpointCommitted,
    HandedOver,
    Progress,
    Redispatched,
    Started,
)
from shared.history.goodput import goodput
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack

# Far longer than any wait below: a run that resumes within them was not waiting for its
# lease to lapse (TTL) or its task to be redelivered (AckWait, 1.5 × TTL).
TTL = 60
WITHIN = 30.0
UNWATCHED = {"BATON_SILENT_AFTER": "0"}
"""The reaper's pulse and departure watches off."""


async def test_a_trainer_killed_under_its_supervisor_hands_its_run_over_at_once(
    tmp_path: Path,
) -> None:
    s = Stack(tmp_path / "stack", trainers=0, lease_ttl=TTL, env=UNWATCHED)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        await s.add_trainer("t1", restart=True)  # as under `baton up`
        nc = await s.client()
        spec = job(
            entry_point="tests.support.workloads:paced", total_steps=240,
            checkpoint={"every_steps": 20}, config={"pace": 0.03},
        )  # fmt: skip
        run_id = await submit(nc, spec)
        log = EventLog(nc, run_id)
        first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the first attempt")
        assert isinstance(first, Started)
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.step >= 40, 60, "a commit at 40"
        )
        # Silent but alive (SIGSTOP), well within the TTL: it keeps its lock, so its run.
        s.signal("t1", signal.SIGSTOP)
        await asyncio.sleep(3)  # the length of the fault, not a wait for something
        s.signal("t1", signal.SIGCONT)
        at = max(e.step for e in log.of(Progress))
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.step > at, 60, "a commit after"
        )
        assert len(log.of(Started)) == 1 and not log.of(HandedOver)

        s.signal("t1", signal.SIGKILL)

        handed = await log.wait_for(lambda e: isinstance(e, HandedOver), WITHIN, "hand-over")
        assert isinstance(handed, HandedOver)
        assert (handed.worker, handed.token) == ("t1", first.token)
        second = await log.wait_for(
            lambda e: isinstance(e, Started) and e.token > first.token, WITHIN, "the resume"
        )
        assert isinstance(second, Started) and second.start_step >= 40
        record = await finished(nc, run_id, 120)
        assert record.state is RunState.COMPLETED and record.attempts == 2
        # Handed over, not found lost: no re-dispatch, and the order is kill → hand-over →
        # the next attempt.
        assert not log.of(Redispatched)
        order = [e for e in log.events if isinstance(e, Started | HandedOver)]
        assert [type(e).__name__ for e in order] == ["Started", "HandedOver", "Started"]
        log.close()

        reference = await submit(nc, msgspec.structs.replace(spec, idempotency_key="ref"))
        assert (await finished(nc, reference, 120)).digest == record.digest
    finally:
        await s.stop()


async def test_a_trainer_gone_without_a_word_hands_its_run_over_when_its_lease_expires(
    tmp_path: Path,
) -> None:
    """A host lost: the trainer and whatever supervised it die together, and nobody on that
    host is left to say so. The run is handed over when the lease expires, by the reaper
    watching the leases — not when the task's AckWait (1.5 × TTL) would deliver it again."""
    s = Stack(tmp_path / "stack", trainers=0, lease_ttl=4, env=UNWATCHED)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        await s.add_trainer("t1")  # no supervisor: nothing restarts it
        nc = await s.client()
        spec = job(
            entry_point="tests.support.workloads:paced", total_steps=200,
            checkpoint={"every_steps": 20}, config={"pace": 0.03},
        )  # fmt: skip
        run_id = await submit(nc, spec)
        log = EventLog(nc, run_id)
        first = await log.wait_for(lambda e: isinstance(e, Started), 60, "the first attempt")
        assert isinstance(first, Started)
        await s.add_trainer("t2")  # idle until the run is handed over
        commit = await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.step >= 40, 60, "a commit at 40"
        )
        assert isinstance(commit, CheckpointCommitted)
        # Some steps past the commit, so that they have to be redone.
        await log.wait_for(
            lambda e: isinstance(e, Progress) and e.step >= commit.step + 12, 60, "steps after it"
        )
        s.signal("t1", signal.SIGKILL)

        handed = await log.wait_for(lambda e: isinstance(e, HandedOver), 60, "hand-over")
        assert isinstance(handed, HandedOver) and "lease expired" in handed.reason
        assert (handed.worker, handed.token) == ("t1", first.token)
        second = await log.wait_for(
            lambda e: isinstance(e, Started) and e.token > first.token, 60, "the resume"
        )
        assert isinstance(second, Started) and second.worker == "t2" and second.start_step >= 40
        record = await finished(nc, run_id, 120)
        assert record.state is RunState.COMPLETED and record.attempts == 2
        # The order proves the hand-over did not wait for the AckWait: the task came back
        # because the reaper handed it over, after the kill and before the next attempt.
        order = [e for e in log.events if isinstance(e, Started | HandedOver | Redispatched)]
        assert [type(e).__name__ for e in order] == ["Started", "HandedOver", "Started"]
        log.close()

        reference = await submit(nc, msgspec.structs.replace(spec, idempotency_key="ref"))
        assert (await finished(nc, reference, 120)).digest == record.digest

        # Its goodput adds up: the categories sum to its wall time, and the time wasted is
        # the steps redone at the step time of the same job run without a fault.
        spent = goodput(await history(nc, run_id))
        clean = goodput(await history(nc, reference))
        assert spent is not None and clean is not None and spent.finished
        assert sum(spent.seconds().values()) == pytest.approx(spent.wall_s)
        assert abs(spent.other_s) < 0.01 * spent.wall_s, spent
        redone = spent.steps_redone
        assert redone >= 12, spent
        step_s = clean.productive_s / spec.total_steps
        assert spent.wasted_s == pytest.approx(redone * step_s, rel=0.35), (spent, step_s)
        assert spent.recovery_s > 1.0 and clean.recovery_s == 0 and clean.wasted_s == 0
        assert spent.goodput < clean.goodput
    finally:
        await s.stop()
