"""Messages that used up their deliveries: dead-lettered, and their runs FAILED.

JetStream stops redelivering a message after `max_deliver` and publishes an advisory —
on core NATS, so the `BATON_ADVISORIES` stream captures it until the reaper has acted. The
message itself stays in its work queue for ever unless removed, so the reaper copies it
to the dead-letter stream with the reason, deletes it, and fails its run.
"""

from __future__ import annotations

import contextlib
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.bus.answer import DeadLetter
from shared.bus.connect import publish
from shared.bus.emit import emit
from shared.contracts import RunRecord, RunState, Task, decode, encode
from shared.contracts.events import Failed
from shared.errors import ContractError
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


class MaxDeliveries(msgspec.Struct, frozen=True):
    """The fields of `io.nats.jetstream.advisory.v1.max_deliver` that we use."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


async def on_advisory(js: JetStreamContext, runs: Runs, msg: Msg) -> None:
    advisory = msgspec.json.decode(msg.data, type=MaxDeliveries)
    reason = f"gave up after {advisory.deliveries} deliveries to consumer {advisory.consumer}"
    try:
        original = await js.get_msg(advisory.stream, advisory.stream_seq)
    except NotFoundError:
        return  # already handled (by another reaper, or a previous try of this one)
    assert original.data is not None and original.subject is not None
    letter = DeadLetter(
        source=advisory.consumer,
        subject=original.subject,
        reason=reason,
        payload=original.data,
        headers=dict(original.headers or {}),
        stream_seq=advisory.stream_seq,
        delivered=advisory.deliveries,
        at=time.time(),
    )
    await publish(
        js,
        names.dlq_subject(advisory.consumer),
        encode(letter),
        msg_id=f"dlq.{advisory.stream}.{advisory.stream_seq}",
    )
    if advisory.stream == names.TASKS_STREAM:
        await _fail_run(js, runs, original.data, reason)
    with contextlib.suppress(NotFoundError):
        await js.delete_msg(advisory.stream, advisory.stream_seq)
    log.warning("dead-lettered %s #%d: %s", advisory.stream, advisory.stream_seq, reason)


async def _fail_run(js: JetStreamContext, runs: Runs, data: bytes, reason: str) -> None:
    try:
        task = decode(data, Task)
    except ContractError:
        return

    def fail(r: RunRecord) -> RunRecord | None:
        if r.state.terminal:
            return None
        return msgspec.structs.replace(r, state=RunState.FAILED, reason=reason, worker=None)

    if await runs.update(task.run_id, fail) is not None:
        await emit(js, Failed(run_id=task.run_id, reason=reason), msg_id=f"failed.{task.run_id}")
