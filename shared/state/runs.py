"""Run records in the `baton_runs` KV bucket, changed only by compare-and-swap.

Updates are raw CAS publishes (`shared.bus.kvwrite`), so a trainer at a site changes the hub's
records the same way a hub service does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import RunRecord, decode, encode

Change = Callable[[RunRecord], RunRecord | None]


class Runs:
    def __init__(self, kv: KeyValue, writer: KvWriter) -> None:
        self._kv = kv
        self._writer = writer

    @classmethod
    async def open(cls, js: JetStreamContext, api_prefix: str | None = None) -> Runs:
        """`js` reads the hub's domain; `api_prefix` routes writes into it from a site."""
        kv = await js.key_value(names.RUNS_BUCKET)
        return cls(kv, KvWriter(js, names.RUNS_BUCKET, api_prefix))

    async def get(self, run_id: str) -> tuple[RunRecord, int] | None:
        try:
            entry = await self._kv.get(run_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        assert entry.value is not None and entry.revision is not None
        return decode(entry.value, RunRecord), entry.revision

    async def create(self, record: RunRecord) -> bool:
        """False when a record with this run id already exists."""
        try:
            await self._kv.create(record.run_id, encode(record))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def update(self, run_id: str, change: Change) -> RunRecord | None:
        """Apply `change` to the newest record until the CAS holds. `change` returns None
        to leave the record alone (the update no longer applies); so does this call."""
        while True:
            found = await self.get(run_id)
            if found is None:
                return None
            record, revision = found
            new = change(record)
            if new is None:
                return None
            new = msgspec.structs.replace(new, updated_at=time.time())
            if await self._writer.put(run_id, encode(new), expected=revision) is not None:
                return new

    async def all(self) -> list[RunRecord]:
        try:
            keys = await self._kv.keys()
        except Exception:  # nats-py raises NoKeysError (a plain Exception subclass) when empty
            return []
        out = []
        for key in keys:
            found = await self.get(key)
            if found is not None:
                out.append(found[0])
        return out
