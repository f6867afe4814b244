"""Runs of several ranks, end to end: a 2-rank DDP job (`examples/ddp.py`, gloo on CPU) on
real trainers, whose ranks are SIGKILLed, SIGTERMed, SIGSTOPped and made to fail.

Two stacks for the module. Three trainers, restarted when they die as `baton up` does: a
rank lost re-forms the group on the spare and the run ends bitwise equal to the
uninterrupted 2-rank run; a preempted rank costs no step; a zombie leader is fenced and its
commit refused; a crash in one rank's code fails the attempt with that rank's traceback.
And a pool that starts with one trainer: a 2-rank job waits and says why, then two 3-rank
jobs compete for four trainers and both finish.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import calls as client
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    AttemptFailed,
    CheckpointCommitted,
    Failed,
    GroupFormed,
    Preempted,
    Progress,
    RankLost,
    Restored,
    Started,
)
from shared.state.runs import Runs
from tests.e2e.jobs import EventLog, fenced_and_refused, finished, history, job, submit
from tests.support.stack import Stack, all_dead, attempt_processes, eventually, named_trainers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

TRAINERS = ("t1", "t2", "t3")


def ddp(
    key: str, *, total: int = 80, ranks: int = 2, pool: str = "default", **config: Any
) -> JobSpec:
    return job(
        name="ddp",
        entry_point="examples.ddp:train",
        total_steps=total,
        ranks=ranks,
        pool=pool,
        seed=11,
        checkpoint={"every_steps": 10},
        config={"steps_sleep": 0.025, **config},
        idempotency_key=key,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def three(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("ranks"), TRAINERS, restart=True) as s:
        yield s


_reference: dict[int, str] = {}


async def reference(nc: Client, total: int = 80) -> str:
    """The weights of the uninterrupted 2-rank run of `total` steps (the pace changes no
    arithmetic)."""
    if total not in _reference:
        run_id = await submit(nc, ddp(f"reference-{total}", total=total, steps_sleep=0.0))
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED, record.reason
        assert record.digest
        _reference[total] = record.digest
    return _reference[total]


async def test_a_clean_finish_ends_every_rank_without_killing_one(three: Stack) -> None:
    """A group that trains to its last step ends with each rank's process exiting by
    itself: after `Finished` a training process leaves promptly, and its trainer — the
    leader for rank 0, a member for rank 1 — waits for that rather than kill it
    (`FINISH_GRACE_S`, services/trainer/child_proc.py)."""
    nc = await three.client()
    run_id = await submit(nc, ddp("clean-finish", total=30, steps_sleep=0.0))
    log = EventLog(nc, run_id)
    formed = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(formed, GroupFormed)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    leader, member = formed.members

    def about_the_run(worker: str) -> list[str]:
        return [ln for ln in three.log(worker).splitlines() if f"{run_id}:" in ln]

    async def exited() -> str | None:
        return next((ln for ln in about_the_run(member) if "rank 1's process exited" in ln), None)

    line = await eventually(exited, 30, "rank 1's process to end")
    assert line.endswith("process exited 0"), line
    for worker in (leader, member):
        said = about_the_run(worker)
        assert not [ln for ln in said if "killed" in ln or "did not exit" in ln], said
    log.close()


async def test_a_group_whose_code_is_slow_to_import_forms_once(three: Stack) -> None:
    """Rank 0's process imports the user's module before it reports its port, and the
    group's key lives a few seconds (2 s here): the leader keeps it alive from the launch,
    so a module that takes 4 s to import (`tests/support/slow_start.py`, as one importing a
    large framework) trains in the group it formed, the first time."""
    nc = await three.client()
    spec = ddp("slow-import", total=20, steps_sleep=0.0)
    slow = msgspec.structs.replace(spec, entry_point="tests.support.slow_start:train")
    run_id = await submit(nc, slow)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.attempts == 1 and record.retries == 0, record
    formed = [e for e in await history(nc, run_id) if isinstance(e, GroupFormed)]
    assert len(formed) == 1, formed


async def test_a_rank_killed_reforms_on_the_spare_and_ends_bitwise_equal(three: Stack) -> None:
    nc = await three.client()
    want = await reference(nc)
    run_id = await submit(nc, ddp("kill-ranks"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(first, GroupFormed) and len(set(first.members)) == 2
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step >= 10, 60, "commit")
    leader_child = attempt_processes(three.pid(first.members[0]))

    # Rank 1's trainer dies: every rank of its group stops, the group forms again.
    three.signal(first.members[1], signal.SIGKILL)
    lost = await log.wait_for(lambda e: isinstance(e, RankLost), 30, "the rank's loss")
    assert isinstance(lost, RankLost)
    assert (lost.rank, lost.lost, lost.epoch) == (1, first.members[1], first.epoch)
    await all_dead(leader_child, "rank 0's process of the broken group")
    second = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, 60, "the group again"
    )
    assert isinstance(second, GroupFormed)
    await log.wait_for(
        lambda e: isinstance(e, Progress) and e.worker == second.members[0] and e.step > lost.step,
        60,
        "the re-formed group training",
    )

    # Now rank 0's: its successor on the host hands the run over, and it forms once more.
    three.signal(second.members[0], signal.SIGKILL)
    third = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > second.epoch, 60, "a third group"
    )
    assert isinstance(third, GroupFormed)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == want
    assert record.retries == 0 and not log.of(AttemptFailed)  # never the user's failure
    # Every group resumed from a committed step.
    committed = {e.step for e in log.of(CheckpointCommitted)} | {0}
    assert all(r.step in committed for r in log.of(Restored))
    log.close()


async def test_sigterm_to_one_rank_checkpoints_the_group_and_loses_no_step(three: Stack) -> None:
    nc = await three.client()
    want = await reference(nc)
    run_id = await submit(nc, ddp("term-rank"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(first, GroupFormed)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 15, 60, "step 15")
    member_child = attempt_processes(three.pid(first.members[1]))
    three.signal(first.members[1], signal.SIGTERM)

    pre = await log.wait_for(lambda e: isinstance(e, Preempted), 30, "the group's preemption")
    assert isinstance(pre, Preempted) and pre.worker == first.members[0]
    assert any(e.step == pre.step and e.token == first.epoch for e in log.of(CheckpointCommitted))
    await all_dead(member_child, "the preempted rank's process")
    second = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, 60, "the group again"
    )
    assert isinstance(second, GroupFormed)
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.at >= second.at, 60, "the resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # zero lost steps
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.digest == want
    assert not log.of(RankLost) and record.retries == 0
    log.close()


async def test_a_zombie_leader_is_fenced_and_its_commit_refused(three: Stack) -> None:
    nc = await three.client()
    want = await reference(nc, 150)
    run_id = await submit(nc, ddp("zombie-rank", total=150))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(first, GroupFormed)
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step >= 10, 60, "commit")
    zombie = first.members[0]
    pid = three.pid(zombie)
    family = attempt_processes(pid)
    os.kill(pid, signal.SIGSTOP)  # past the TTL: its lease lapses, its group is over
    try:
        second = await log.wait_for(
            lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, 60, "a new group"
        )
        assert isinstance(second, GroupFormed) and zombie not in second.members
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.token == second.epoch,
            60,
            "the new group's commit",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    # Its newest complete checkpoint, committed again now, is refused.
    await fenced_and_refused(log, three.store_url, zombie, first.epoch, family, ranks=2)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.digest == want
    log.close()


async def test_a_crash_in_one_ranks_code_is_a_user_failure(three: Stack) -> None:
    nc = await three.client()
    spec = ddp("crash-rank", fail_rank=1, fail_at=5, steps_sleep=0.0)
    spec = job(**{**_fields(spec), "limits": {"max_retries": 1}})
    run_id = await submit(nc, spec)
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.FAILED
    events = await history(nc, run_id)
    # The first attempt failed and was retried; the second used up the retries.
    (tried,) = [e for e in events if isinstance(e, AttemptFailed)]
    assert tried.rank == 1 and "ValueError" in tried.detail and record.retries == 2
    failed = next(e for e in events if isinstance(e, Failed))
    assert "ValueError" in failed.detail and "rank 1" in failed.reason
    assert not [e for e in events if isinstance(e, RankLost)]

    # Every rank of every attempt stopped.
    async def none_left() -> bool:
        return not any(attempt_processes(three.pid(t)) for t in TRAINERS)

    await eventually(none_left, 15, "every rank's process to exit")


async def test_a_rank_that_hangs_reaches_the_failure_policy(three: Stack) -> None:
    """Rank 1's code hangs at step 12 in every attempt (a deadlocked loader): rank 0 waits
    in its next collective until `collective_timeout_s`, and the group breaks. The first
    break could be a lost machine and re-forms the group, uncounted; a break again before
    any checkpoint past the one it resumed from (step 10) is the run's own hang, counted —
    and with one retry allowed the run is FAILED, saying so. Seen before: every break re-formed the
    group as after a lost rank, uncounted, and the run never ended."""
    nc = await three.client()
    spec = ddp("hang-rank", hang_rank=1, hang_at=12, steps_sleep=0.0)
    spec = job(**{**_fields(spec), "collective_timeout_s": 4, "limits": {"max_retries": 1}})
    run_id = await submit(nc, spec)
    record = await finished(nc, run_id, timeout=240)
    assert record.state is RunState.FAILED and record.retries == 2, record
    assert "broke again before any checkpoint past step 10" in (record.reason or ""), record
    events = await history(nc, run_id)
    lost = [e for e in events if isinstance(e, RankLost)]
    assert len(lost) == 1, lost  # the first break: uncounted
    (tried,) = [e for e in events if isinstance(e, AttemptFailed)]
    assert "a rank's code hangs" in tried.reason, tried

    async def none_left() -> bool:
        return not any(attempt_processes(three.pid(t)) for t in TRAINERS)

    await eventually(none_left, 30, "every rank's process to exit")


async def test_a_cancelled_group_checkpoints_and_every_rank_stops(three: Stack) -> None:
    nc = await three.client()
    run_id = await submit(nc, ddp("cancel-ranks", total=400))
    log = EventLog(nc, run_id)
    formed = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(formed, GroupFormed)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 15, 60, "step 15")
    await client.cancel(nc, run_id, "not needed")
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.CANCELLED and not record.group
    # The group checkpointed where it stopped: the record names a committed step past 15.
    assert any(e.step == record.step for e in log.of(CheckpointCommitted)) and record.step > 15

    async def none_left() -> bool:
        return not any(attempt_processes(three.pid(w)) for w in formed.members)

    await eventually(none_left, 15, "every rank's process to exit")
    log.close()


def _fields(spec: JobSpec) -> dict[str, Any]:
    import msgspec

    out: dict[str, Any] = msgspec.to_builtins(spec)
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """One trainer to begin with; tests add more."""
    async with named_trainers(tmp_path_factory.mktemp("pool"), ("p1",), lease_ttl=4) as s:
        yield s


async def test_a_group_never_trains_partly_formed_and_says_why(pool: Stack) -> None:
    nc = await pool.client()
    run_id = await submit(nc, ddp("alone", total=30, steps_sleep=0.0))
    runs = await Runs.open(nc.jetstream())

    async def waiting() -> str | None:
        found = await runs.get(run_id)
        return found[0].waiting if found else None

    # The scheduler admits no run its pool has not the trainers for, and says so.
    why = await eventually(waiting, 30, "the run to say why it waits")
    assert "needs 2 trainers at once" in why and "'default' has 1 live" in why, why
    found = await runs.get(run_id)
    assert found is not None
    record = found[0]
    assert record.state is RunState.QUEUED and record.attempts == 0 and not record.group
    assert not attempt_processes(pool.pid("p1"))  # no rank's process was even started
    assert not [e for e in await history(nc, run_id) if isinstance(e, Started | GroupFormed)]

    await pool.add_trainer("p2")
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED
    formed = [e for e in await history(nc, run_id) if isinstance(e, GroupFormed)]
    assert len(formed) == 1 and sorted(formed[0].members) == ["p1", "p2"]
    assert record.waiting is None


async def test_two_groups_wanting_the_same_trainers_are_admitted_one_at_a_time(
    pool: Stack,
) -> None:
    """Two runs of two ranks, queued before their pool has a trainer: each would hold the
    one trainer the other needs if both were let go for them. The scheduler admits a group
    only once its pool has every rank's trainer free, so the older forms first and the
    younger after it, both complete, and no leader ever had to give way. (Their trainers
    never give up on their own: `BATON_FORM_WAIT` is far beyond the test's bound.)"""
    nc = await pool.client()
    a = await submit(nc, ddp("race-a", total=30, steps_sleep=0.0, pool="race"))
    b = await submit(nc, ddp("race-b", total=30, steps_sleep=0.0, pool="race"))
    race = {"BATON_POOL": "race", "BATON_FORM_WAIT": "600"}
    for name in ("r1", "r2"):
        await pool.add_trainer(name, race)
    done = [await finished(nc, run_id, timeout=90) for run_id in (a, b)]
    assert all(r.state is RunState.COMPLETED for r in done), [r.reason for r in done]
    stepped = [e.at for e in await history(nc, a) if isinstance(e, Progress)]
    began = [e for e in await history(nc, b) if isinstance(e, Started)]
    assert stepped and began and began[0].at >= max(stepped), (stepped, began)
    assert not any("gave way" in pool.log(name) for name in ("r1", "r2")), "a leader gave way"


async def test_two_groups_competing_for_the_same_trainers_both_finish(pool: Stack) -> None:
    nc = await pool.client()
    for name in ("p3", "p4"):
        await pool.add_trainer(name, {"BATON_FORM_WAIT": "600"})
    a = await submit(nc, ddp("group-a", total=30, ranks=3, steps_sleep=0.0))
    b = await submit(nc, ddp("group-b", total=30, ranks=3, steps_sleep=0.0))
    for run_id in (a, b):
        record = await finished(nc, run_id, timeout=150)
        assert record.state is RunState.COMPLETED, record.reason
        formed = [e for e in await history(nc, run_id) if isinstance(e, GroupFormed)]
        assert formed and all(len(set(f.members)) == 3 for f in formed)
