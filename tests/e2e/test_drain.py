"""Taking a host out, and an operator's checkpoint, end to end: `baton drain`, `undrain` and
`checkpoint` run as an operator runs them (their own processes), against real trainers under
`baton up`'s authorization — every server's log is audited for permission violations when
the stack stops (`tests/support/audit.py`).

A drained trainer hands its run over at its next checkpoint, losing no step, and the run
ends with the weights of an undisturbed run; it takes nothing while drained — through its
own restart — and takes work again once undrained. A rank held for another trainer's group
leaves its group the same way, and the group forms again without it. A checkpoint asked for
is committed at a step the job's cadence would never have chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from baton.cli import drains
from shared.bus import names
from shared.contracts import JobSpec, RunState, decode, encode
from shared.contracts.control import Drain, TakeCheckpoint, WorkerInfo
from shared.contracts.events import (
    CheckpointCommitted,
    GroupFormed,
    HandedOver,
    Preempted,
    Progress,
    RankLost,
    Restored,
    Started,
)
from shared.contracts.letters import DeadLetter
from shared.state.drains import Drains
from shared.state.runs import Runs
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.cli import as_json, baton
from tests.support.proxy import Proxy
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.operations

WITHIN = 90.0
"""A bound against a hang: each wait ends on the event it waits for."""


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Stack]:
    """The hub's services; each test adds the trainers it names."""
    s = Stack(tmp_path / "stack", trainers=0, lease_ttl=4)
    await s.start(("dispatcher", "checkpointer", "reaper"))
    try:
        yield s
    finally:
        await s.stop()


def paced(total: int, every: int = 20, pace: float = 0.03) -> JobSpec:
    """The paced regression: step-derived batches, so the same job ends with the same
    weights however often it is handed over."""
    return job(
        entry_point="tests.support.workloads:paced", total_steps=total,
        checkpoint={"every_steps": every}, config={"pace": pace},
    )  # fmt: skip


async def beat(nc: Client, worker: str, ok: Callable[[WorkerInfo], bool], what: str) -> WorkerInfo:
    """The worker's heartbeat once it says `ok`."""

    async def check() -> WorkerInfo | None:
        info = await drains.heartbeat(nc, worker)
        return info if info is not None and ok(info) else None

    return await eventually(check, WITHIN, what, every=0.2)


async def started_on(nc: Client, run_id: str) -> str:
    """The worker of the run's first attempt."""
    log = EventLog(nc, run_id)
    try:
        first = await log.wait_for(lambda e: isinstance(e, Started), WITHIN, f"{run_id} to start")
        assert isinstance(first, Started)
        return first.worker
    finally:
        log.close()


async def test_a_drained_trainer_hands_over_and_takes_nothing_until_undrained(
    pool: Stack,
) -> None:
    await pool.add_trainer("a", restart=True)  # restarted when it dies, as under `baton up`
    await pool.ready(("trainer",))
    nc = await pool.client()
    spec = paced(240)
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), WITHIN, "the first attempt")
    assert isinstance(first, Started) and first.worker == "a", first
    await pool.add_trainer("b")
    await beat(nc, "b", lambda w: w.run_id is None, "b, idle")
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, WITHIN, "a's first commit"
    )
    # What `baton drain` reads to say what it handed over: a's heartbeat naming the run.
    await beat(nc, "a", lambda w: w.run_id == run_id, "a, holding the run")
    at = max(e.step for e in log.of(Progress))

    done = await as_json(pool, "drain", "a", "--reason", "swap a disk")

    assert done["idle"] and done["live"] and done["run_id"] == run_id, done
    assert done["ended"] is None, done  # handed over, not finished meanwhile
    pre = await log.wait_for(lambda e: isinstance(e, Preempted), WITHIN, "the hand-over")
    assert isinstance(pre, Preempted) and pre.worker == "a", pre
    assert done["step"] == pre.step >= at, (done, at)  # checkpointed when drained, not before
    second = await log.wait_for(
        lambda e: isinstance(e, Started) and e.worker == "b", WITHIN, "the run on b"
    )
    assert isinstance(second, Started) and second.start_step == pre.step  # no step lost
    committed = [(c.step, c.token) for c in log.of(CheckpointCommitted)]
    assert (pre.step, first.token) in committed, committed
    workers = {w["worker"]: w for w in await as_json(pool, "workers")}
    assert workers["a"]["drained"] and workers["a"]["run_id"] is None, workers
    assert not workers["b"]["drained"], workers

    # Drained through its own restart: the order is the key, read before the first fetch.
    old = pool.pid("a")
    pool.signal("a", signal.SIGKILL)
    await beat(nc, "a", lambda w: w.pid != old and w.drained, "a, restarted and drained")

    # A second job waits for b, busy with the first: a takes nothing.
    busy = await submit(nc, paced(3000, every=500))
    record = await finished(nc, run_id, WITHIN)
    assert record.state is RunState.COMPLETED and record.attempts == 2, record
    assert record.retries == 0 and not log.of(HandedOver) and len(log.of(Preempted)) == 1
    assert await started_on(nc, busy) == "b"
    log.close()

    code, out, err = await baton(pool, "undrain", "a")
    assert code == 0 and "undrained" in out, err
    await beat(nc, "a", lambda w: not w.drained, "a, undrained")
    third = await submit(nc, job(total_steps=40))
    assert await started_on(nc, third) == "a"  # b still trains the second
    assert (await finished(nc, third, WITHIN)).state is RunState.COMPLETED
    code, _, err = await baton(pool, "cancel", busy)
    assert code == 0, err

    reference = await submit(nc, msgspec.structs.replace(spec, idempotency_key="reference"))
    assert (await finished(nc, reference, WITHIN)).digest == record.digest


async def test_draining_an_idle_trainer_and_the_key_alone(pool: Stack) -> None:
    await pool.add_trainer("a")
    await pool.ready(("trainer",))
    nc = await pool.client()
    await beat(nc, "a", lambda w: w.run_id is None, "a, idle")
    code, out, err = await baton(pool, "drain", "a")
    assert code == 0 and "drained and idle" in out, (out, err)
    code, out, err = await baton(pool, "undrain", "a")
    assert code == 0 and "undrained" in out, (out, err)
    await beat(nc, "a", lambda w: not w.drained, "a, undrained")

    # The key alone is the order: written with no wake, as if the wake were lost.
    operator = Drains(nc.jetstream())
    await operator.drain(Drain(worker="a", reason="by hand", at=0.0))
    await beat(nc, "a", lambda w: w.drained, "a, drained by its key")

    # A queued run has no training process to checkpoint: the CLI says so, and a request
    # that reaches the dispatcher anyway is dead-lettered with its reason.
    queued = await submit(nc, job(total_steps=20))
    code, _, err = await baton(pool, "checkpoint", queued)
    assert code == 2 and "QUEUED" in err, err
    await nc.jetstream().publish(
        names.steer_subject(queued), encode(TakeCheckpoint(run_id=queued)),
        headers={"Nats-Msg-Id": f"checkpoint.{queued}.by-hand"},
    )  # fmt: skip
    letter = await eventually(lambda: dead_letter(nc), WITHIN, "the dead letter")
    assert "QUEUED: only a run in training can checkpoint" in letter.reason, letter

    await operator.undrain("a")
    await beat(nc, "a", lambda w: not w.drained, "a, undrained by its key")
    assert await started_on(nc, queued) == "a"
    assert (await finished(nc, queued, WITHIN)).state is RunState.COMPLETED

    code, out, err = await baton(pool, "drain", "nobody", "--wait", "0")
    assert code == 0 and "no live trainer" in out, (out, err)
    code, out, err = await baton(pool, "undrain", "nobody")
    assert code == 0 and "undrained" in out, (out, err)
    code, out, err = await baton(pool, "undrain", "nobody")
    assert code == 0 and "was not drained" in out, (out, err)
    code, _, err = await baton(pool, "drain", "a.*")
    assert code == 2 and "not a worker id" in err, err


async def dead_letter(nc: Client) -> DeadLetter | None:
    """The dispatcher's newest dead letter, if any."""
    try:
        msg = await nc.jetstream().get_last_msg(names.DLQ_STREAM, names.dlq_subject("dispatcher"))
    except NotFoundError:
        return None
    assert msg.data is not None
    return decode(msg.data, DeadLetter)


async def committed_as_answered(
    nc: Client, log: EventLog, done: dict[str, Any], total: int
) -> int:
    """The step `baton checkpoint` answered (`done`), once its commit's event came and the
    run completed in one attempt."""
    step = done["step"]
    assert step is not None and 10 <= step < total, done
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step == step, WITHIN, "its event"
    )
    record = await finished(nc, done["run_id"], WITHIN)
    assert record.state is RunState.COMPLETED and record.attempts == 1, record
    assert isinstance(step, int)
    return step


async def test_an_operator_checkpoint_commits_a_step_off_the_cadence(pool: Stack) -> None:
    await pool.add_trainer("a")
    await pool.ready(("trainer",))
    nc = await pool.client()
    total = 300
    run_id = await submit(nc, paced(total, every=10_000))  # only the final one on its own
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 10, WITHIN, "step 10")

    done = await as_json(pool, "checkpoint", run_id, "--reason", "before a risky change")

    step = await committed_as_answered(nc, log, done, total)
    assert sorted(c.step for c in log.of(CheckpointCommitted)) == [step, total]
    log.close()

    code, _, err = await baton(pool, "checkpoint", run_id)
    assert code == 2 and "COMPLETED" in err, err
    code, _, err = await baton(pool, "checkpoint", "rnosuchrun")
    assert code == 3 and "no run" in err, err


async def test_an_operator_checkpoint_outlives_a_lost_wake(tmp_path: Path) -> None:
    """The trainer's link drops every byte while the checkpoint is asked: the dispatcher's
    wake to it is lost (core NATS keeps nothing for a peer that does not read). The request
    is in the run's record, which the trainer reads once its link is back: the checkpoint is
    written and committed, and `baton checkpoint` gets its answer. Seen before: the request
    itself travelled as that core-NATS message, and the asker was told none came. The lease
    outlasts the cut (15 s), so nothing but the wake is lost."""
    async with contextlib.AsyncExitStack() as scope:
        stack = Stack(tmp_path / "stack", trainers=0, lease_ttl=15)
        scope.push_async_callback(stack.stop)
        await stack.start(("dispatcher", "checkpointer", "reaper"))
        link = await scope.enter_async_context(Proxy("127.0.0.1", stack.nats.port))
        await stack.add_trainer("edge", {"NATS_URL": link.url})
        await stack.ready(("trainer",))
        nc = await stack.client()
        total = 600
        run_id = await submit(nc, paced(total, every=10_000))
        log = EventLog(nc, run_id)
        moving = await log.wait_for(
            lambda e: isinstance(e, Progress) and e.step >= 10, WITHIN, "step 10"
        )
        assert moving
        link.blackhole()
        asking = asyncio.create_task(
            as_json(stack, "checkpoint", run_id, "--reason", "through a lost wake")
        )
        runs = await Runs.open(nc.jetstream())

        async def asked() -> bool:
            found = await runs.get(run_id)
            return found is not None and found[0].checkpoints_asked == 1

        await eventually(asked, WITHIN, "the request in the run's record (its wake sent)")
        link.restore()
        await committed_as_answered(nc, log, await asyncio.wait_for(asking, WITHIN), total)
        log.close()


@pytest.mark.slow
async def test_a_drained_rank_leaves_its_group_which_forms_again_without_it(
    pool: Stack,
) -> None:
    for name in ("t1", "t2", "t3"):
        await pool.add_trainer(name)
    await pool.ready(("trainer",))
    nc = await pool.client()
    spec = job(
        name="ddp", entry_point="examples.ddp:train", total_steps=240, ranks=2, seed=11,
        checkpoint={"every_steps": 10}, config={"steps_sleep": 0.025},
    )  # fmt: skip
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), WITHIN, "the group")
    assert isinstance(first, GroupFormed)
    leader, member = first.members
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 15, WITHIN, "step 15")

    # What `baton drain` reads to say what it handed over: the member's heartbeat naming it.
    await beat(nc, member, lambda w: w.run_id == run_id and w.rank == 1, "the member, its rank")
    done = await as_json(pool, "drain", member)

    assert done["idle"] and done["run_id"] == run_id and done["rank"] == 1, done
    assert done["ended"] is None, done  # handed over, not finished meanwhile
    pre = await log.wait_for(lambda e: isinstance(e, Preempted), WITHIN, "the hand-over")
    assert isinstance(pre, Preempted) and pre.worker == leader, pre
    assert done["step"] == pre.step, (pre, done)
    second = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, WITHIN, "the group again"
    )
    assert isinstance(second, GroupFormed) and member not in second.members, second
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.at >= second.at, WITHIN, "the resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # no step lost
    record = await finished(nc, run_id, WITHIN)
    assert record.state is RunState.COMPLETED and record.retries == 0, record
    assert not log.of(RankLost)
    log.close()

    reference = await submit(nc, msgspec.structs.replace(spec, idempotency_key="reference"))
    assert (await finished(nc, reference, WITHIN)).digest == record.digest
