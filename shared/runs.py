"""Run records in the `baton_runs` KV bucket, changed only by compare-and-swap."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import names
from shared.contracts import RunRecord, decode, encode

Change = Callable[[RunRecord], RunRecord | None]


class Runs:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext) -> Runs:
        return cls(await js.key_value(names.RUNS_BUCKET))

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
            try:
                await self._kv.update(run_id, encode(new), last=revision)
                return new
            except KeyWrongLastSequenceError:
                continue

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
