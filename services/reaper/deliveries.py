"""Messages that used up their deliveries: dead-lettered, and their runs FAILED.

JetStream stops redelivering a message after `max_deliver` and publishes an advisory —
on core NATS, so the `BATON_ADVISORIES` stream captures it until the reaper has acted. The
message itself stays in its work queue for ever unless removed, so the reaper copies it
to the dead-letter stream with the reason, deletes it, and fails its run.
"""

from __future__ import annotations

import contextlib
import logging

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.bus.answer import post_letter
from shared.contracts import Task, decode
from shared.contracts.letters import MaxDeliveries
from shared.errors import ContractError
from shared.state import transitions
from shared.state.endings import settle
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


async def on_advisory(js: JetStreamContext, runs: Runs, msg: Msg) -> None:
    advisory = decode(msg.data, MaxDeliveries)
    reason = f"gave up after {advisory.deliveries} deliveries to consumer {advisory.consumer}"
    try:
        original = await js.get_msg(advisory.stream, advisory.stream_seq)
    except NotFoundError:
        return  # already handled (by another reaper, or a previous try of this one)
    assert original.data is not None and original.subject is not None
    await post_letter(
        js, advisory.stream, source=advisory.consumer, subject=original.subject,
        reason=reason, payload=original.data, headers=dict(original.headers or {}),
        stream_seq=advisory.stream_seq, delivered=advisory.deliveries,
    )  # fmt: skip
    # A group's call for a rank that used up its deliveries is only dropped: its leader
    # calls again the next time it forms the group.
    if advisory.stream == names.TASKS_STREAM and original.subject.startswith(
        f"{names.PREFIX}.tasks."
    ):
        await _fail_run(js, runs, original.data, reason)
    with contextlib.suppress(NotFoundError):
        await js.delete_msg(advisory.stream, advisory.stream_seq)
    log.warning("dead-lettered %s #%d: %s", advisory.stream, advisory.stream_seq, reason)


async def _fail_run(js: JetStreamContext, runs: Runs, data: bytes, reason: str) -> None:
    try:
        task = decode(data, Task)
    except ContractError:
        return
    await settle(js, runs, task.run_id, transitions.fail(reason))
