"""What the notifier has sent: one mark per notification and receiver, in `baton_alerts`.

Invariant: a mark is written once (a create, which a second writer loses) after its
receiver answered for good — 2xx, or a refusal that went to the dead-letter stream — and
before the event that caused it is acked. So an event redelivered (a nak for another
receiver that was down, a restart, a lost ack) skips every receiver that has its mark, and
each receiver is told of each event once — but for the window between a receiver's answer
and its mark being stored (docs/alerts.md, "Guarantees").

Marks carry a per-key TTL of `KEEP_S`, longer than the events stream keeps an event, so
the bucket holds at most what the stream does.
"""

from __future__ import annotations

import contextlib
import time
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.contracts import encode
from shared.contracts.alerts import Mark

KEEP_S = 31 * 86400
"""A day longer than `BATON_EVENTS` keeps an event (30 days): no event outlives its marks."""
KNOWN_MAX = 100_000
"""Marks remembered in memory (past it, the bucket is asked again)."""


def mark_key(alert_key: str, receiver: str) -> str:
    return f"{alert_key}.{receiver}"


class Marks:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self._known: set[str] = set()
        """Marks this process has seen stored: asked of the bucket once."""

    @classmethod
    async def open(cls, js: JetStreamContext) -> Marks:
        return cls(await js.key_value(names.ALERTS_BUCKET))

    async def has(self, key: str) -> bool:
        if key in self._known:
            return True
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return False
        if entry.value is None:  # an expired mark's marker
            return False
        self._remember(key)
        return True

    async def put(self, key: str, outcome: Literal["sent", "refused"], status: int | None) -> None:
        """Store the mark; one already there (another notifier's, or ours before a
        restart) is as good."""
        mark = Mark(outcome=outcome, status=status, at=time.time())
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._kv.create(key, encode(mark), msg_ttl=KEEP_S)
        self._remember(key)

    def _remember(self, key: str) -> None:
        if len(self._known) >= KNOWN_MAX:
            self._known.clear()
        self._known.add(key)
