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

from shared.bus import names
from shared.bus.connect import publish
from shared.contracts import encode
from shared.errors import PermanentError, TransientError

log = logging.getLogger("baton.outcome")

BUG_DELAY_S = 5.0
MAX_LETTER_PAYLOAD = 512 * 1024
"""A letter carries its payload base64-encoded (4/3 the size), so a poison message near the
1 MiB message limit would not fit in one: the publish would fail and the message would never
be dead-lettered. The beginning is what a person reads."""


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
    js: JetStreamContext,
    msg: Msg,
    source: str,
    handler: Callable[[Msg], Awaitable[None]],
    *,
    site: str = "",
) -> None:
    try:
        await handler(msg)
    except TransientError as exc:
        log.info("%s: transient failure, retrying in %.1fs: %s", source, exc.delay, exc)
        await msg.nak(delay=exc.delay)
    except PermanentError as exc:
        await dead_letter(js, msg, source, str(exc), site=site)
        await msg.term()
    except Exception:
        log.exception("%s: unexpected failure handling %s; will retry", source, msg.subject)
        await msg.nak(delay=BUG_DELAY_S)
    else:
        await msg.ack()


async def dead_letter(
    js: JetStreamContext, msg: Msg, source: str, reason: str, *, site: str = ""
) -> None:
    """At a site (`site`), the letter goes through the site's outbox to the hub."""
    meta = msg.metadata
    if len(msg.data) > MAX_LETTER_PAYLOAD:
        reason = (
            f"{reason} (payload cut to its first {MAX_LETTER_PAYLOAD} of {len(msg.data)} bytes)"
        )
    letter = DeadLetter(
        source=source,
        subject=msg.subject,
        reason=reason,
        payload=msg.data[:MAX_LETTER_PAYLOAD],
        headers=dict(msg.headers or {}),
        stream_seq=meta.sequence.stream,
        delivered=meta.num_delivered,
        at=time.time(),
    )
    await publish(
        js,
        names.at_site(names.dlq_subject(source), site),
        encode(letter),
        # The site is part of the id: a site's and the hub's streams number alike.
        msg_id=f"dlq.{site or names.HUB_DOMAIN}.{meta.stream}.{meta.sequence.stream}",
    )
