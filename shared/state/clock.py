"""The hub's clock: the one clock every time a decision compares is read from.

Invariant: a duration that decides anything is a difference of two readings of one clock —
the hub's JetStream server (its stamp on a stored message, `stamp`, and its time now,
`server_now`), or one process's monotonic clock. A host's wall clock (`time.time()`,
every `at`, `created_at` and `updated_at` a message carries) is shown, never compared with
another host's: a trainer, a site or a client whose clock is minutes off changes nothing
that is decided (docs/architecture.md, "Clocks").

The server stamps each message as its stream stores it (`Nats-Time-Stamp` on a direct get,
`time` on a message get, the ack subject's timestamp on a delivery), and says what its
clock reads in every stream info reply (`ts`, nats-server 2.10 and later). A clustered
hub's stream is stamped by its leader; nodes of one cluster are kept in sync (NTP) as
any cluster's are, and nothing here compares them closer than seconds.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import NamedTuple

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from shared.state.keys import keys

API = "$JS.API"


async def server_now(nc: Client, stream: str, api: str = API, timeout: float = 5.0) -> float:
    """The hub server's clock now, in seconds since the epoch, as the leader of `stream`
    reads it (one stream info request; the caller's permissions must allow it)."""
    reply = await nc.request(f"{api}.STREAM.INFO.{stream}", b"", timeout=timeout)
    body = json.loads(reply.data)
    if "error" in body:
        raise RuntimeError(f"stream info of {stream}: {body['error'].get('description')}")
    ts = body.get("ts")
    if not isinstance(ts, str):
        raise RuntimeError(f"stream info of {stream} carries no server time (nats-server < 2.10?)")
    return parse(ts)


def parse(rfc3339: str) -> float:
    """Seconds since the epoch of a server timestamp (`2026-01-02T03:04:05.123456789Z`);
    nanoseconds are cut to microseconds, which is all a float keeps anyway."""
    text = rfc3339.strip().replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    return datetime.datetime.fromisoformat(text).timestamp()


def stamp(when: datetime.datetime | None) -> float:
    """A stamp nats-py parsed (`RawStreamMsg.time`, `Msg.metadata.timestamp`) as seconds."""
    if when is None:
        raise ValueError("the server gave this message no timestamp")
    return when.timestamp()


def age(now: float, stamped: float) -> float:
    """How long before `now` a message was stored: both are the server's, so never less
    than 0 unless the server's own clock stepped back."""
    return max(0.0, now - stamped)


def created(entry: KeyValue.Entry) -> float:
    """The server's stamp of a KV entry a watch delivered (its `created`: nats-py fills it
    from the delivery's metadata, a datetime despite its annotation)."""
    when: object = entry.created
    if not isinstance(when, datetime.datetime):
        raise ValueError(f"the server gave {entry.bucket}/{entry.key} no timestamp")
    return when.timestamp()


class Stamped(NamedTuple):
    key: str
    value: bytes
    at: float
    """The hub server's stamp of the key's newest revision (its clock)."""


async def stamped_values(js: JetStreamContext, bucket: str) -> list[Stamped]:
    """Each live key of a KV bucket, in name order, with its value and the server's stamp of
    its newest revision (one message get per key: a KV get leaves the stamp out)."""
    out = []
    for key in sorted(await keys(js, bucket)):
        try:
            msg = await js.get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.{key}")
        except NotFoundError:  # deleted or expired between listing and reading
            continue
        if msg.data and (msg.headers or {}).get("KV-Operation") not in ("DEL", "PURGE"):
            out.append(Stamped(key, msg.data, stamp(msg.time)))
    return out


class ServerClock:
    """The hub server's clock, read now and then and carried forward in between.

    Invariant: `now()` is the server's time at the last `sync` plus the seconds since, as
    this process's monotonic clock counts them — one reading of the server's clock and one
    duration of one process's clock; this host's wall clock plays no part. For a process
    that must stamp what it pushes with the hub's time without asking the server each time
    (the dashboard's live streams). Off by at most the reading's round trip.
    """

    def __init__(self, nc: Client, stream: str, resync_s: float = 60.0) -> None:
        self.nc = nc
        self.stream = stream
        self.resync_s = resync_s
        self._read: tuple[float, float] | None = None
        """(the server's time, this process's monotonic time) at the last sync."""

    async def sync(self) -> float:
        """Ask the server (one stream info request), and return its time now."""
        server = await server_now(self.nc, self.stream)
        self._read = (server, time.monotonic())
        return server

    def now(self) -> float:
        """The server's time now, carried from the last sync (which must have happened)."""
        if self._read is None:
            raise RuntimeError("the hub's clock has not been read yet: sync() first")
        server, mono = self._read
        return server + (time.monotonic() - mono)

    async def read(self) -> float:
        """As `now`, asking the server again when the last sync is `resync_s` old (or none)."""
        if self._read is None or time.monotonic() - self._read[1] >= self.resync_s:
            return await self.sync()
        return self.now()
