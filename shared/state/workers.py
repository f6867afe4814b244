"""The worker registry: trainers' heartbeats in the `baton_workers` bucket.

A heartbeat's `at` is its trainer's wall clock: shown, never compared. How long ago a
trainer was heard is the hub's to say (`heard`): its server stamps each heartbeat as the
bucket stores it — for a site's trainer, as the hub sources it from the site's outbox,
which is when the hub heard it."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared.bus import names
from shared.contracts import decode
from shared.contracts.control import WorkerInfo
from shared.state.clock import stamped_values
from shared.state.keys import keys


class Heard(NamedTuple):
    info: WorkerInfo
    at: float
    """The hub server's stamp of the heartbeat (its clock, seconds since the epoch)."""


async def live_workers(js: JetStreamContext) -> list[WorkerInfo]:
    """Every trainer whose heartbeat has not expired (the server's per-key TTL removes a
    dead trainer's entry), in name order."""
    kv = await js.key_value(names.WORKERS_BUCKET)
    out = []
    for key in sorted(await keys(js, names.WORKERS_BUCKET)):
        with contextlib.suppress(KeyNotFoundError):  # expired between listing and reading
            entry = await kv.get(key)
            if entry.value:
                out.append(decode(entry.value, WorkerInfo))
    return out


async def heard_workers(js: JetStreamContext) -> list[Heard]:
    """As `live_workers`, each with the server's stamp of its newest heartbeat."""
    stamped = await stamped_values(js, names.WORKERS_BUCKET)
    return [Heard(decode(s.value, WorkerInfo), s.at) for s in stamped]
