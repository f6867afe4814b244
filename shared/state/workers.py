"""The worker registry: trainers' heartbeats in the `baton_workers` bucket."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared.bus import names
from shared.contracts import decode
from shared.contracts.control import WorkerInfo


async def live_workers(js: JetStreamContext) -> list[WorkerInfo]:
    """Every trainer whose heartbeat has not expired (the server's per-key TTL removes a
    dead trainer's entry), in name order."""
    kv = await js.key_value(names.WORKERS_BUCKET)
    try:
        keys = await kv.keys()
    except Exception:  # nats-py raises a bare NoKeysError when the bucket is empty
        return []
    out = []
    for key in sorted(keys):
        with contextlib.suppress(KeyNotFoundError):  # expired between listing and reading
            entry = await kv.get(key)
            if entry.value:
                out.append(decode(entry.value, WorkerInfo))
    return out
