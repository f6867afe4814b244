"""A lease that expires hands its run over at once — the task is delivered again then, not
after its AckWait — and only an expiry does: a renewed or released lease hands nothing over."""

from __future__ import annotations

import asyncio
import time

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo

from services.reaper.lapses import Lapses
from shared.bus import names
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.contracts import JobSpec, RunRecord, RunState, Task, convert, decode, encode, spec_hash
from shared.contracts.events import Event, HandedOver
from shared.state.handover import hand_over
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
# Far beyond every wait here: a task delivered again within them was handed over.
ACK_WAIT_S = 600.0


async def held(
    js: JetStreamContext, runs: Runs, run_id: str, ttl_s: int, worker: str = "w1"
) -> tuple[Lease, Msg]:
    """A run as `worker` holds it: its task delivered and unanswered, its lease taken, and
    its record RUNNING under the lease's token, naming the delivery."""
    task = Task(run_id=run_id, spec=SPEC, dispatch=1)
    await js.publish(names.task_subject("default", run_id), encode(task))
    sub = await js.pull_subscribe_bind(names.trainer_consumer("default"), names.TASKS_STREAM)
    msg = next(m for m in await sub.fetch(1, timeout=5) if decode(m.data, Task).run_id == run_id)
    lease = Lease(js, run_id, worker, ttl_s=ttl_s)
    assert await lease.acquire()
    now = time.time()
    record = RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=RunState.RUNNING, worker=worker, token=lease.token, attempts=1, delivery=msg.reply,
    )  # fmt: skip
    assert await runs.create(record)
    return lease, msg


async def redelivered(js: JetStreamContext) -> int:
    info: ConsumerInfo = await js.consumer_info(
        names.TASKS_STREAM, names.trainer_consumer("default")
    )
    return info.num_redelivered or 0


async def handovers(js: JetStreamContext, run_id: str) -> list[HandedOver]:
    sub = await js.subscribe(names.event_subject(run_id, "handed_over"), ordered_consumer=True)
    out = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return out
            event = decode(msg.data, Event)
            assert isinstance(event, HandedOver)
            out.append(event)
    finally:
        await sub.unsubscribe()


async def test_an_expired_lease_hands_its_run_over_before_the_ack_wait(
    authorized: AuthorizedHub,
) -> None:
    nc = await authorized.connect("operator")  # the trainer's side, and the test's reads
    js = nc.jetstream()
    await ensure_consumer(js, names.TASKS_STREAM, trainer_consumer("default", ACK_WAIT_S, 100))
    runs = await Runs.open(js)
    reaper = await authorized.connect("reaper")  # the code under test, as its own role
    rjs = reaper.jetstream()
    lapses = Lapses(reaper, rjs, await Runs.open(rjs), None)
    await lapses.start()
    try:
        # Renewed past its TTL, then released: neither is an expiry.
        kept, kept_msg = await held(js, runs, "rkept", ttl_s=1)
        for _ in range(6):
            assert await kept.renew()
            await kept_msg.in_progress()
            await asyncio.sleep(0.3)  # the holder's renewal cadence, a third of its TTL
        await kept.release()
        # Left to lapse: silent for a whole TTL.
        lost, _ = await held(js, runs, "rlost", ttl_s=1)

        # One pull subscription for every poll: a subscription made per poll and dropped
        # when its fetch timed out can still be handed the message, which then waits
        # there, unseen, for its AckWait (a machine under load made that happen).
        sub = await js.pull_subscribe_bind(names.trainer_consumer("default"), names.TASKS_STREAM)

        async def again() -> Msg | None:
            try:
                return (await sub.fetch(1, timeout=1))[0]
            except NatsTimeoutError:
                return None

        try:
            msg = await eventually(again, 20, "the task delivered again")
        finally:
            await sub.unsubscribe()
        assert decode(msg.data, Task).run_id == "rlost" and msg.metadata.num_delivered == 2
        # The watch handles the bucket's entries in order: the kept run's release came first.
        assert await redelivered(js) == 1
        found = await runs.get("rlost")
        assert found is not None and found[0].delivery is None, "handed over once, in the record"
        [event] = await handovers(js, "rlost")
        assert (event.worker, event.token) == ("w1", lost.token)
        assert await handovers(js, "rkept") == []
        # Whoever comes second — the trainer's successor, a second reaper — hands nothing over.
        assert not await hand_over(reaper, rjs, runs, "rlost", lost.token, "again")
        assert not await lapses.lapsed("rlost")
    finally:
        await lapses.stop()
