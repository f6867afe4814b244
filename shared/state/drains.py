"""The drains bucket (`baton_drains`): which trainers an operator took out of their pool.

Invariant: a trainer is drained exactly while its key (`names.drain_key`) holds a `Drain`.
Operators write and delete it (`baton drain`, `baton undrain`; the dashboard's role may
too); the trainer it names only reads it, by key — at start, before every heartbeat and on
a `wake` — so the order outlives the trainer's restarts and any lost message. A worker id
is a KV key as it is for the heartbeats, so `baton drain` refuses a name that cannot be one
(a wildcard above all).
"""

from __future__ import annotations

import re

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.contracts import decode, encode
from shared.contracts.control import Drain
from shared.errors import ContractError

WORKER_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
"""What a worker id must look like to be a key (NATS's own rule for KV keys); a key may
not start or end with a dot either."""


def check_worker(worker: str) -> str:
    """`worker` if it can name a trainer's key, else `ContractError` saying why."""
    if not WORKER_KEY.match(worker) or worker.startswith(".") or worker.endswith("."):
        raise ContractError(f"{worker!r} is not a worker id (letters, digits, -/_=.)")
    return worker


class Drains:
    """The bucket as one client sees it (at a site, `js` is the hub's domain: reads cross)."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._js.key_value(names.DRAINS_BUCKET)
        return self._kv

    async def get(self, worker: str) -> Drain | None:
        """The worker's drain, or None when it is not drained. A value that does not decode
        (written by hand) still drains it: an operator meant something by it."""
        try:
            entry = await (await self._bucket()).get(names.drain_key(check_worker(worker)))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            return decode(entry.value, Drain)
        except ContractError:
            return Drain(worker=worker, reason="(an unreadable drain record)", at=0.0)

    async def drain(self, record: Drain) -> None:
        """Take `record.worker` out of its pool (again: a second drain only rewrites it)."""
        key = names.drain_key(check_worker(record.worker))
        await (await self._bucket()).put(key, encode(record))

    async def undrain(self, worker: str) -> bool:
        """Let `worker` take work again; whether it was drained."""
        was = await self.get(worker)
        if was is not None:
            await (await self._bucket()).delete(names.drain_key(worker))
        return was is not None
