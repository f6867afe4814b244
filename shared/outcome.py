"""The one place where a handler's outcome becomes a JetStream answer.

    returned             -> ack
    TransientError       -> nak, redelivered after the error's delay
    PermanentError       -> copy to the dead-letter stream with the reason, then term
    anything else (bug)  -> logged with its traceback, nak with a delay (never lost)

Dead-lettering happens *before* term: if we died in between, the message would be
redelivered and dead-lettered again (the copy carries a Nats-Msg-Id, so it is stored once)
rather than vanish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import names
from shared.connect import publish
from shared.contracts import encode
from shared.errors import PermanentError, TransientError

log = logging.getLogger("baton.outcome")

BUG_DELAY_S = 5.0


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    """The consumer that gave up on the message."""
    subject: str
    reason: str
    payload: bytes
    headers: dict[str, str]
    stream_seq: int
    delivered: int
    at: float


async def handle(
    js: JetStreamContext, msg: Msg, source: str, handler: Callable[[Msg], Awaitable[None]]
) -> None:
    try:
        await handler(msg)
    except TransientError as exc:
        log.info("%s: transient failure, retrying in %.1fs: %s", source, exc.delay, exc)
        await msg.nak(delay=exc.delay)
    except PermanentError as exc:
        await dead_letter(js, msg, source, str(exc))
        await msg.term()
    except Exception:
        log.exception("%s: unexpected failure handling %s; will retry", source, msg.subject)
        await msg.nak(delay=BUG_DELAY_S)
    else:
        await msg.ack()


async def dead_letter(js: JetStreamContext, msg: Msg, source: str, reason: str) -> None:
    meta = msg.metadata
    letter = DeadLetter(
        source=source,
        subject=msg.subject,
        reason=reason,
        payload=msg.data,
        headers=dict(msg.headers or {}),
        stream_seq=meta.sequence.stream,
        delivered=meta.num_delivered,
        at=time.time(),
    )
    await publish(
        js,
        names.dlq_subject(source),
        encode(letter),
        msg_id=f"dlq.{meta.stream}.{meta.sequence.stream}",
    )
