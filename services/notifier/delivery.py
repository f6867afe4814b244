"""Sending an alert to its receivers: one POST each, answered for good or to be tried again.

Invariant: a receiver is sent an alert only while it has no mark for it (`marks.py`), and
gets its mark only once it answered for good — 2xx (sent), or a refusal: a 4xx other than
408 and 429, or a redirect, after which the notification is dead-lettered with its reason
and never tried again. Anything else (no connection, a timeout, 408, 429, 5xx) leaves the
receiver unmarked, to be tried again later with the alert's other unmarked receivers; one
receiver that is down never holds back the others.

The HTTP client is aiohttp, already installed with the S3 client (aiobotocore runs on it):
a well-kept asyncio client with connection pooling, TLS verification on by default and
timeouts per request, on the same event loop as the NATS client — nothing hand-written
speaks HTTP here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal, NamedTuple

import aiohttp
from nats.js import JetStreamContext

from services.notifier.alert import Alert
from services.notifier.config import Receiver
from services.notifier.formats import body
from services.notifier.marks import Marks, mark_key
from shared.bus import names
from shared.bus.answer import MAX_LETTER_PAYLOAD
from shared.bus.connect import publish
from shared.contracts import encode
from shared.contracts.letters import DeadLetter

log = logging.getLogger("baton.notifier")

SOURCE = "notifier"
POST_TIMEOUT_S = 10.0
"""The most one POST may take, connecting included; then it is tried again later."""
SHOWN_BODY = 200
"""Bytes of a refusing receiver's answer kept in the dead letter's reason."""
RETRYABLE = frozenset({408, 429})

Outcome = Literal["sent", "retry", "refused"]


class Answer(NamedTuple):
    outcome: Outcome
    status: int | None
    reason: str


class Origin(NamedTuple):
    """What a dead letter of the alert copies: the event it was made from, or for a site's
    alert the alert itself (subject `names.site_alert_subject`, sequence 0)."""

    subject: str
    payload: bytes
    headers: dict[str, str]
    stream_seq: int
    delivered: int


def judge(status: int) -> Outcome:
    if 200 <= status < 300:
        return "sent"
    if status in RETRYABLE or status >= 500:
        return "retry"
    return "refused"


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S),
        headers={"User-Agent": "baton-notifier"},
    )


async def post(client: aiohttp.ClientSession, receiver: Receiver, alert: Alert) -> Answer:
    """POST `alert` in the receiver's format, and say what its answer means."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": f"baton-{alert.key}"}
    try:
        async with client.post(
            receiver.url, data=body(alert, receiver.format), headers=headers, allow_redirects=False
        ) as resp:
            said = (await resp.content.read(SHOWN_BODY)).decode(errors="replace").strip()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        # A message may quote the URL, whose path can be a secret (a Slack webhook's).
        what = str(exc).replace(receiver.url, receiver.label)
        return Answer("retry", None, f"{type(exc).__name__}: {what}".rstrip(": "))
    return Answer(judge(status), status, f"HTTP {status}" + (f": {said}" if said else ""))


class Delivery:
    def __init__(self, js: JetStreamContext, client: aiohttp.ClientSession, marks: Marks) -> None:
        self.js = js
        self.client = client
        self.marks = marks

    async def send(
        self, alert: Alert, receivers: tuple[Receiver, ...], origin: Origin
    ) -> list[str]:
        """Send `alert` to each of `receivers` without a mark for it, all at once. Returns
        why each receiver that must be tried again failed; empty once all have answered
        for good."""
        failed = await asyncio.gather(*(self._one(alert, r, origin) for r in receivers))
        return [f for f in failed if f]

    async def _one(self, alert: Alert, receiver: Receiver, origin: Origin) -> str:
        key = mark_key(alert.key, receiver.id)
        if await self.marks.has(key):
            return ""
        answer = await post(self.client, receiver, alert)
        about = alert.run_id or alert.site
        if answer.outcome == "retry":
            return f"{receiver.label}: {answer.reason}"
        if answer.outcome == "refused":
            log.warning(
                "%s (%s %s): %s refused it (%s); dead-lettered, not retried",
                alert.key, alert.kind, about, receiver.label, answer.reason,
            )  # fmt: skip
            await self._dead_letter(alert, receiver, origin, answer)
        else:
            log.info("%s (%s %s): told %s", alert.key, alert.kind, about, receiver.label)
        await self.marks.put(key, answer.outcome, answer.status)
        return ""

    async def _dead_letter(
        self, alert: Alert, receiver: Receiver, origin: Origin, answer: Answer
    ) -> None:
        """One letter per notification and receiver (its id names both), stored once
        however often this is retried."""
        reason = (
            f"receiver {receiver.label} ({receiver.format}) refused the {alert.kind} "
            f"notification of {alert.run_id or alert.site}: {answer.reason}"
        )
        letter = DeadLetter(
            source=SOURCE, subject=origin.subject, reason=reason,
            payload=origin.payload[:MAX_LETTER_PAYLOAD],
            headers={**origin.headers, "Baton-Receiver": receiver.label},
            stream_seq=origin.stream_seq, delivered=origin.delivered, at=time.time(),
        )  # fmt: skip
        await publish(
            self.js,
            names.dlq_subject(SOURCE),
            encode(letter),
            msg_id=f"dlq.{SOURCE}.{mark_key(alert.key, receiver.id)}",
        )
