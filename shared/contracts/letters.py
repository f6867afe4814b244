"""Dead letters, and the JetStream advisory that makes the reaper write one."""

from __future__ import annotations

import msgspec


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A message Baton gave up on, with why, in `BATON_DLQ`."""

    source: str
    """The consumer that gave up on the message."""
    subject: str
    reason: str
    payload: bytes
    headers: dict[str, str]
    stream_seq: int
    delivered: int
    at: float


class MaxDeliveries(msgspec.Struct, frozen=True):
    """The fields of `io.nats.jetstream.advisory.v1.max_deliver` that Baton uses (the
    server's advisory has more; they are ignored)."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int
