"""One trainer `Attempt` against a real nats-server, a real checkpointer and a real training
child, without the rest of the stack: one test per row of the outcome table in
`services/trainer/verdicts.py`, each checking all four of its columns — the run record, the
run's events, the lease, and how the task message was answered (read back from the real
trainer consumer: its state, and whether and when it delivers the message again)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from baton.client.calls import history
from services.checkpointer.service import Checkpointer
from services.trainer.attempt import Attempt
from services.trainer.child_proc import Child
from services.trainer.service import NATS_SECRETS
from services.trainer.verdicts import Outcome
from shared import config
from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.checkpoint import commit
from shared.checkpoint.store import Store, open_store
from shared.config import Settings
from shared.contracts import (
    JobSpec,
    Pointer,
    RunRecord,
    RunState,
    Task,
    convert,
    decode,
    encode,
    spec_hash,
)
from shared.contracts.events import (
    AttemptFailed,
    Cancelled,
    Completed,
    Event,
    Failed,
    Fenced,
    Preempted,
    Progress,
    kind_of,
)
from shared.state.endings import settle
from shared.state.lease import Lease, holder, is_held
from shared.state.policy import Policy, load_table
from shared.state.pools import Pools
from shared.state.runs import Runs
from tests.support.stack import eventually

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

POOL = "default"
WORKER = "w1"
TTL = 3
"""Lease TTL: the keeper beats every second, the task's AckWait is 4.5 s."""
PACED = "tests.support.workloads:paced"
SMALL = {"dim": 4, "hidden": 4, "batch": 4}
ENDINGS = ("completed", "failed", "cancelled")
ATTEMPT_S = 60.0
"""Upper bound on one attempt, so a hang fails the test instead of the suite's timeout."""


def child_env(settings: Settings) -> dict[str, str]:
    """The environment `Trainer._child_env` gives a training child."""
    env = {k: v for k, v in os.environ.items() if k not in NATS_SECRETS}
    env["BATON_SPOOL"] = str(Path(settings.work_dir, "spool").resolve())
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


class CountedLease(Lease):
    """A lease that counts its releases: each outcome releases at most once."""

    releases = 0

    async def release(self) -> None:
        self.releases += 1
        await super().release()


@dataclass
class Rig:
    """What `Trainer` holds for its attempts, built the same way, plus a real checkpointer."""

    nc: Client
    settings: Settings
    store: Store
    runs: Runs
    pools: Pools
    tasks: JetStreamContext.PullSubscription
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    beat_now: asyncio.Event = field(default_factory=asyncio.Event)
    children: list[Child] = field(default_factory=list)
    spares: list[Child] = field(default_factory=list)
    running: list[asyncio.Task[Outcome]] = field(default_factory=list)
    seen: dict[str, list[Event]] = field(default_factory=dict)

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    async def submit(self, run_id: str, entry_point: str, total_steps: int, **spec: Any) -> Task:
        """A QUEUED run record and its task on the tasks stream, as the dispatcher leaves
        them; the run's events are watched from here on."""
        job = convert(
            {"name": run_id, "entry_point": entry_point, "total_steps": total_steps, **spec},
            JobSpec,
        )
        now = time.time()
        record = RunRecord(
            run_id=run_id, spec=job, spec_hash=spec_hash(job), created_at=now, updated_at=now
        )
        assert await self.runs.create(record)
        seen = self.seen.setdefault(run_id, [])

        async def collect(msg: Msg) -> None:
            seen.append(decode(msg.data, Event))

        await self.nc.subscribe(names.events_of_run(run_id), cb=collect)
        task = Task(run_id=run_id, spec=job)
        await self.js.publish(names.task_subject(POOL, run_id), encode(task))
        return task

    async def fetch(self, timeout: float) -> Msg | None:
        """The next delivery of the trainer consumer within `timeout` seconds, or None."""
        try:
            msgs = await self.tasks.fetch(1, timeout=timeout)
        except (TimeoutError, NatsTimeoutError):
            return None
        return msgs[0]

    async def attempt(self, msg: Msg) -> Attempt:
        """As `Trainer.on_task` and `_attempt` do: decode the task, take the run's lease,
        hand a fresh child to a new `Attempt`."""
        task = decode(msg.data, Task)
        lease = CountedLease(
            self.js, task.run_id, self.settings.worker_id, self.settings.lease_ttl_s,
            key=task.lease_key,
        )  # fmt: skip
        assert await lease.acquire(), "the lease must be free when an attempt starts"
        child = self.spares.pop(0) if self.spares else await self.prestart(spare=False)
        return Attempt(
            self.nc, self.settings, self.store, self.runs, self.pools, task, lease, child,
            (self.stop, self.hurry), self.beat_now,
        )  # fmt: skip

    async def running_slowly(self, run_id: str) -> tuple[Attempt, asyncio.Task[Outcome]]:
        """A slow run (no periodic checkpoints) whose attempt has done its first step."""
        await self.submit(
            run_id, PACED, 500, checkpoint={"every_steps": None}, config={**SMALL, "pace": 0.05}
        )
        msg = await self.fetch(5)
        assert msg is not None, "the task must be delivered"
        attempt = await self.attempt(msg)
        running = self.launch(attempt, msg)
        await self.stepped(run_id)
        return attempt, running

    def launch(self, attempt: Attempt, msg: Msg) -> asyncio.Task[Outcome]:
        """Run `attempt` in the background (cancelled at teardown if a test fails first)."""
        task = asyncio.create_task(attempt.run(msg))
        self.running.append(task)
        return task

    async def prestart(self, spare: bool = True) -> Child:
        """A child that imports torch ahead of its attempt, as the trainer's spare does."""
        child = await Child.start(child_env(self.settings))
        self.children.append(child)
        if spare:
            self.spares.append(child)
        return child

    async def record(self, run_id: str) -> tuple[RunRecord, int]:
        found = await self.runs.get(run_id)
        assert found is not None, f"no record for {run_id}"
        return found

    async def stepped(self, run_id: str) -> None:
        """Until the attempt has reported a finished step (a `progress` event)."""

        async def progressed() -> bool:
            return any(isinstance(e, Progress) for e in self.seen[run_id])

        await eventually(progressed, 30, f"{run_id} to make progress")

    async def events(self, run_id: str) -> tuple[list[Event], Counter[str]]:
        """The run's history as `baton` reads it, and how often each kind appears."""
        events = await history(self.nc, run_id)
        return events, Counter(kind_of(e) for e in events)

    async def consumer(self) -> ConsumerInfo:
        info: ConsumerInfo = await self.js.consumer_info(
            names.TASKS_STREAM, names.trainer_consumer(POOL)
        )
        return info

    async def assert_acked(self) -> None:
        """The task message was acked: nothing pending or in flight, the work queue empty,
        and nothing delivered again."""
        info = await self.consumer()
        counts = (info.num_ack_pending, info.num_pending, info.num_redelivered)
        assert counts == (0, 0, 0), f"ack pending, pending, redelivered: {counts}"
        stream = await self.js.stream_info(names.TASKS_STREAM)
        # A work queue deletes a message once it is acked.
        assert stream.state.messages == 0, f"{stream.state.messages} tasks left in the queue"


def only(events: list[Event], kind: type[Event]) -> Any:
    found = [e for e in events if isinstance(e, kind)]
    assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
    return found[0]


def absent(counts: Counter[str], *kinds: str) -> None:
    there = {k: counts[k] for k in kinds if counts[k]}
    assert not there, f"unexpected events: {there}"


@pytest.fixture
async def rig(declared: Client, tmp_path: Path) -> AsyncIterator[Rig]:
    nc = declared
    js = nc.jetstream()
    settings = config.load(
        {
            "BATON_STORE": f"file://{tmp_path / 'store'}",
            "BATON_LEASE_TTL": str(TTL),
            "BATON_GRACE": "20",
            "BATON_WORK_DIR": str(tmp_path / "work"),
            "BATON_WORKER_ID": WORKER,
        }
    )
    checkpointer = Checkpointer(nc, settings)
    await checkpointer.start()
    halt = asyncio.Event()
    serving = asyncio.create_task(checkpointer.serve(halt))
    consumer = trainer_consumer(POOL, settings.ack_wait_s, settings.max_deliver)
    await ensure_consumer(js, names.TASKS_STREAM, consumer)
    tasks = await js.pull_subscribe_bind(names.trainer_consumer(POOL), names.TASKS_STREAM)
    store = open_store(settings.store_url)
    pools = Pools(js, Policy(js, load_table(settings.pools_file)))
    rig = Rig(nc, settings, store, await Runs.open(js), pools, tasks)
    try:
        await rig.prestart()
        yield rig
    finally:
        for running in rig.running:
            running.cancel()
        await asyncio.gather(*rig.running, return_exceptions=True)
        for child in rig.children:
            child.kill()
            await child.wait()
        halt.set()
        serving.cancel()  # rather than wait out its fetch: nothing is being committed now
        await asyncio.gather(serving, return_exceptions=True)
        await checkpointer.close()
        await store.close()
        await tasks.unsubscribe()


async def test_completed_writes_the_result_releases_the_lease_and_acks(rig: Rig) -> None:
    run_id = "rdone"
    await rig.submit(
        run_id, "examples.regression:train", 10,
        checkpoint={"every_steps": 5}, config={"hidden": 8, "batch": 8},
    )  # fmt: skip
    msg = await rig.fetch(5)
    assert msg is not None, "the task must be delivered"
    attempt = await rig.attempt(msg)

    outcome = await asyncio.wait_for(attempt.run(msg), ATTEMPT_S)

    assert outcome is Outcome.COMPLETED, outcome
    record, _ = await rig.record(run_id)
    latest = await commit.read_latest(rig.store, run_id)
    assert latest is not None
    pointer: Pointer = latest[0]
    manifest = await commit.load_manifest(rig.store, pointer.manifest)
    assert (pointer.step, pointer.final, pointer.token) == (10, True, attempt.lease.token), pointer
    assert record.state is RunState.COMPLETED, record
    assert (record.step, record.digest) == (10, manifest.digest), record
    assert record.digest and "loss" in record.metrics, record
    assert record.metrics == manifest.metrics, (record.metrics, manifest.metrics)
    assert (record.worker, record.reason, record.retries, record.attempts) == (
        None, None, 0, 1,
    ), record  # fmt: skip
    assert record.token == attempt.lease.token and not record.announce_pending, record
    assert record.busy_s > 0, record

    events, counts = await rig.events(run_id)
    completed: Completed = only(events, Completed)
    assert (completed.step, completed.digest) == (10, record.digest), completed
    assert counts["started"] == 1 and counts["checkpoint_committed"] == 2, counts
    absent(counts, "failed", "cancelled", "fenced", "preempted", "attempt_failed")

    assert not await is_held(rig.js, run_id), "COMPLETED must release the lease"
    await rig.assert_acked()


async def test_cancelled_checkpoints_then_ends_the_run_and_acks(rig: Rig) -> None:
    run_id = "rcancel"
    attempt, running = await rig.running_slowly(run_id)

    def ask(r: RunRecord) -> RunRecord:
        return msgspec.structs.replace(r, cancel_requested="cancelled by the test")

    assert await rig.runs.update(run_id, ask) is not None
    rig.beat_now.set()
    outcome = await asyncio.wait_for(running, ATTEMPT_S)

    assert outcome is Outcome.CANCELLED, outcome
    record, _ = await rig.record(run_id)
    assert record.state is RunState.CANCELLED, record
    assert (record.reason, record.worker, record.retries) == (
        "cancelled by the test", None, 0,
    ), record  # fmt: skip
    assert not record.announce_pending, record
    latest = await commit.read_latest(rig.store, run_id)
    assert latest is not None, "a cancelled attempt checkpoints before it stops"
    assert 0 < latest[0].step < 500 and not latest[0].final, latest[0]
    assert latest[0].token == attempt.lease.token, latest[0]
    assert record.step == latest[0].step, f"record at {record.step}, committed {latest[0]}"

    events, counts = await rig.events(run_id)
    cancelled: Cancelled = only(events, Cancelled)
    assert cancelled.reason == "cancelled by the test", cancelled
    assert counts["checkpoint_committed"] == 1, counts
    absent(counts, "completed", "failed", "fenced", "preempted", "attempt_failed")

    assert not await is_held(rig.js, run_id), "CANCELLED must release the lease"
    assert isinstance(attempt.lease, CountedLease) and attempt.lease.releases == 1
    await rig.assert_acked()


async def test_stopped_when_the_run_ended_elsewhere_changes_nothing_and_acks(rig: Rig) -> None:
    run_id = "rstopped"
    await rig.submit(run_id, PACED, 500, checkpoint={"every_steps": None}, config=SMALL)
    msg = await rig.fetch(5)
    assert msg is not None, "the task must be delivered"
    attempt = await rig.attempt(msg)
    running = rig.launch(attempt, msg)
    await rig.stepped(run_id)

    def hard_timeout(r: RunRecord) -> RunRecord | None:  # what the reaper's sweep writes
        if r.state.terminal:
            return None
        return msgspec.structs.replace(r, state=RunState.FAILED, reason="hard_timeout: test")

    assert await settle(rig.js, rig.runs, run_id, hard_timeout) is not None
    ended, revision = await rig.record(run_id)
    rig.beat_now.set()
    outcome = await asyncio.wait_for(running, ATTEMPT_S)

    assert outcome is Outcome.STOPPED, outcome
    assert attempt.child.returncode == -9, "the child is killed, not asked to checkpoint"
    record, after = await rig.record(run_id)
    assert after == revision and record == ended, f"the record changed: {record}"
    assert (record.state, record.reason) == (RunState.FAILED, "hard_timeout: test"), record

    events, counts = await rig.events(run_id)
    failed: Failed = only(events, Failed)  # the reaper's, and no second one
    assert failed.reason == "hard_timeout: test", failed
    absent(counts, "completed", "cancelled", "fenced", "preempted", "attempt_failed")
    absent(counts, "checkpoint_committed")

    assert not await is_held(rig.js, run_id), "STOPPED must release the lease"
    await rig.assert_acked()


async def test_preempted_checkpoints_releases_and_naks_for_at_once(rig: Rig) -> None:
    run_id = "rpreempt"
    attempt, running = await rig.running_slowly(run_id)

    rig.stop.set()  # SIGTERM
    outcome = await asyncio.wait_for(running, ATTEMPT_S)

    assert outcome is Outcome.PREEMPTED, outcome
    latest = await commit.read_latest(rig.store, run_id)
    assert latest is not None, "a preempted attempt checkpoints before it stops"
    step = latest[0].step
    assert 0 < step < 500 and latest[0].token == attempt.lease.token, latest[0]
    record, _ = await rig.record(run_id)
    assert record.state is RunState.RUNNING, record
    assert (record.worker, record.token, record.retries) == (None, attempt.lease.token, 0), record
    assert record.busy_s > 0, "the attempt's time is booked"
    assert record.step == step, f"record at {record.step}, committed {step}"

    events, counts = await rig.events(run_id)
    preempted: Preempted = only(events, Preempted)
    assert (preempted.step, preempted.worker) == (step, WORKER), preempted
    assert counts["checkpoint_committed"] == 1, counts
    absent(counts, *ENDINGS, "fenced", "attempt_failed")

    assert not await is_held(rig.js, run_id), "PREEMPTED must release the lease"
    # nak(0): delivered again at once — well before the AckWait (4.5 s after the keeper's
    # last in_progress) would bring back a message nobody answered.
    again = await rig.fetch(2.0)
    assert again is not None, "a preempted task must be delivered again at once"
    assert decode(again.data, Task).run_id == run_id, again.data
    assert again.metadata.num_delivered == 2, again.metadata


async def retry(rig: Rig, run_id: str) -> tuple[Attempt, Msg]:
    """The first attempt of a run whose code raises at step 3, with one retry allowed: it
    fails; returns the attempt and the task's next delivery (after the nak's delay)."""
    await rig.submit(
        run_id, "tests.support.workloads:boom", 50,
        checkpoint={"every_steps": None}, config={"boom_at": 3}, limits={"max_retries": 1},
    )  # fmt: skip
    msg = await rig.fetch(5)
    assert msg is not None, "the task must be delivered"
    attempt = await rig.attempt(msg)
    outcome = await asyncio.wait_for(attempt.run(msg), ATTEMPT_S)
    assert outcome is Outcome.RETRY, outcome
    assert not await is_held(rig.js, run_id), "RETRY must release the lease"
    # nak(2^1 s): not delivered again within a second, but after the delay.
    assert await rig.fetch(1.0) is None, "the retry must wait out its back-off"
    again = await rig.fetch(5.0)
    assert again is not None, "the task must come back after its back-off"
    assert again.metadata.num_delivered == 2, again.metadata
    return attempt, again


async def test_retry_counts_the_failure_releases_and_naks_with_back_off(rig: Rig) -> None:
    run_id = "rretry"
    attempt, _ = await retry(rig, run_id)
    # (the message column is checked inside `retry`: a nak delayed by 2 s)

    record, _ = await rig.record(run_id)
    assert record.state is RunState.RUNNING, record
    assert (record.retries, record.attempts, record.reason) == (1, 1, None), record
    assert (record.token, record.stop_token) == (attempt.lease.token, None), record

    events, counts = await rig.events(run_id)
    failed: AttemptFailed = only(events, AttemptFailed)
    assert (failed.attempt, failed.worker) == (1, WORKER), failed
    assert failed.reason == "training process exited with code 1", failed
    assert "RuntimeError: boom at step 3" in failed.detail, f"log tail: {failed.detail!r}"
    absent(counts, *ENDINGS, "fenced", "preempted")


async def test_failed_when_the_retries_are_used_up_ends_the_run_and_acks(rig: Rig) -> None:
    run_id = "rfailed"
    await rig.prestart()  # the second attempt's child, importing while the first one runs
    first, msg = await retry(rig, run_id)
    second = await rig.attempt(msg)
    assert second.lease.token > first.lease.token, (first.lease.token, second.lease.token)

    outcome = await asyncio.wait_for(second.run(msg), ATTEMPT_S)

    assert outcome is Outcome.FAILED, outcome
    record, _ = await rig.record(run_id)
    assert record.state is RunState.FAILED, record
    assert record.reason == "training process exited with code 1", record
    assert (record.retries, record.attempts) == (2, 2), record
    assert record.token == second.lease.token and not record.announce_pending, record

    events, counts = await rig.events(run_id)
    failed: Failed = only(events, Failed)
    assert failed.reason == record.reason, failed
    assert "RuntimeError: boom at step 3" in failed.detail, f"log tail: {failed.detail!r}"
    assert counts["attempt_failed"] == 1, "only the first attempt was a retry"
    assert counts["started"] == 2, counts
    absent(counts, "completed", "cancelled", "fenced", "preempted")

    assert not await is_held(rig.js, run_id), "FAILED must release the lease"
    await rig.assert_acked()


@pytest.mark.parametrize("how", ["lease taken", "orphan kill"])
async def test_fenced_kills_the_child_and_touches_neither_lease_nor_message(
    rig: Rig, how: str
) -> None:
    run_id = "rfenced"
    await rig.submit(run_id, PACED, 500, checkpoint={"every_steps": None}, config=SMALL)
    msg = await rig.fetch(5)
    assert msg is not None, "the task must be delivered"
    attempt = await rig.attempt(msg)
    running = rig.launch(attempt, msg)
    await rig.stepped(run_id)
    ours, revision = await rig.record(run_id)

    if how == "lease taken":
        # Another worker's lease under the run's key: the keeper's next renewal loses its
        # CAS, and the lease is not free to take back.
        intruder = encode({"worker": "intruder", "token": 0})
        taken = await KvWriter(rig.js, names.LEASES_BUCKET).put(run_id, intruder, ttl_s=60)
        assert taken is not None
        reason, lease_holder = "the lease was taken over by another worker", "intruder"
        rig.beat_now.set()
    else:
        # The reaper's `kill` command (`Trainer._on_command`): the lease is still ours, and
        # a fenced attempt keeps it all the same; it lapses by itself.
        attempt.orphaned("held elsewhere")
        reason, lease_holder = "orphan: held elsewhere", WORKER
    outcome = await asyncio.wait_for(running, ATTEMPT_S)

    assert outcome is Outcome.FENCED, outcome
    assert attempt.child.returncode == -9, "a fenced attempt kills its child at once"
    record, after = await rig.record(run_id)
    assert after == revision and record == ours, f"the record changed: {record}"
    assert (record.state, record.worker, record.token) == (
        RunState.RUNNING, WORKER, attempt.lease.token,
    ), record  # fmt: skip

    events, counts = await rig.events(run_id)
    fenced: Fenced = only(events, Fenced)
    assert (fenced.worker, fenced.token, fenced.reason) == (WORKER, attempt.lease.token, reason)
    absent(counts, *ENDINGS, "preempted", "attempt_failed")

    assert await holder(rig.js, run_id) == lease_holder, "a fenced attempt must not release"
    kv = await rig.js.key_value(names.LEASES_BUCKET)
    entry = await kv.get(run_id)
    last = taken if how == "lease taken" else attempt.lease.revision
    assert entry.revision == last, "the lease is as the fenced attempt found it"

    # Not answered: still in flight, and delivered again only once its AckWait runs out.
    info = await rig.consumer()
    counts_now = (info.num_ack_pending, info.num_pending, info.num_redelivered)
    assert counts_now == (1, 0, 0), f"ack pending, pending, redelivered: {counts_now}"
    assert await rig.fetch(1.0) is None, "an unanswered task waits for its AckWait"
    if how != "lease taken":
        return  # the same path as above; the wait for the AckWait is not worth repeating
    again = await rig.fetch(rig.settings.ack_wait_s + 3)
    assert again is not None, "an unanswered task comes back after its AckWait"
    assert again.metadata.num_delivered == 2, again.metadata
