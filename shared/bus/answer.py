"""The one place where a handler's outcome becomes a JetStream answer.

    returned             -> ack
    TransientError       -> nak, redelivered after the error's delay
    PermanentError       -> copy to the dead-letter stream with the reason, then term
    NATS unavailable     -> nak, redelivered after UNAVAILABLE_DELAY_S (a stream electing
                            its leader, a server gone: nothing is wrong with the message)
    anything else (bug)  -> logged with its traceback, nak with a delay (never lost)

Dead-lettering happens *before* term: if we died in between, the message would be
redelivered and dead-lettered again (the copy carries a Nats-Msg-Id, so it is stored once)
rather than vanish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus import names
from shared.bus.connect import UNAVAILABLE, publish
from shared.contracts import encode
from shared.contracts.letters import DeadLetter
from shared.errors import PermanentError, TransientError

log = logging.getLogger("baton.outcome")

BUG_DELAY_S = 5.0
UNAVAILABLE_DELAY_S = 1.0
MAX_LETTER_PAYLOAD = 512 * 1024
"""A letter carries its payload base64-encoded (4/3 the size), so a poison message near the
1 MiB message limit would not fit in one: the publish would fail and the message would never
be dead-lettered. The beginning is what a person reads."""


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
    except UNAVAILABLE as exc:
        log.warning(
            "%s: NATS unavailable (%s), retrying in %.1fs", source, type(exc).__name__,
            UNAVAILABLE_DELAY_S,
        )  # fmt: skip
        await msg.nak(delay=UNAVAILABLE_DELAY_S)
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
    await post_letter(
        js, meta.stream, source=source, subject=msg.subject, reason=reason, payload=msg.data,
        headers=dict(msg.headers or {}), stream_seq=meta.sequence.stream,
        delivered=meta.num_delivered, site=site,
    )  # fmt: skip


async def post_letter(
    js: JetStreamContext,
    stream: str,
    *,
    source: str,
    subject: str,
    reason: str,
    payload: bytes,
    headers: dict[str, str],
    stream_seq: int,
    delivered: int,
    site: str = "",
) -> None:
    """Copy a message of `stream` to the dead-letter stream, stored once however often this
    is retried (its id names the message: `names.letter_id`)."""
    if len(payload) > MAX_LETTER_PAYLOAD:
        reason = f"{reason} (payload cut to its first {MAX_LETTER_PAYLOAD} of {len(payload)} bytes)"
    letter = DeadLetter(
        source=source, subject=subject, reason=reason, payload=payload[:MAX_LETTER_PAYLOAD],
        headers=headers, stream_seq=stream_seq, delivered=delivered, at=time.time(),
    )  # fmt: skip
    await publish(
        js,
        names.at_site(names.dlq_subject(source), site),
        encode(letter),
        msg_id=names.letter_id(stream, stream_seq, site),
    )
