"""Run records in the `baton_runs` KV bucket, changed only by compare-and-swap.

Updates are raw CAS publishes (`shared.bus.kvwrite`), so a trainer at a site changes the hub's
records the same way a hub service does.

Live runs are found without reading the history: every run has a key in the live index
(`baton_live`) from before its record exists until the reaper retires it — once it has been
over for `BATON_GC_AGE` and its terminal event is stored. Retiring archives the record
(`shared.state.archive`), gives the record in the runs bucket a TTL of `BATON_RETAIN_ENDED`,
and removes the live key, in that order, so a crash between two steps leaves the run live and
the next sweep repeats them. The sweep, `baton runs` and garbage collection read the live
index: their cost follows the live runs, whatever the history.

`updated_at` is the wall clock of whichever host wrote the revision (a trainer at a site,
the reaper…): shown, never compared. How long ago a revision was written is asked of the
hub's server, which stamps each revision as it stores it (`Stamped.written`,
`shared.state.clock`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import RunRecord, decode, encode
from shared.state import archive
from shared.state.clock import stamp
from shared.state.keys import keys

Change = Callable[[RunRecord], RunRecord | None]


class Stamped(NamedTuple):
    """A record as `Runs.get` reads it, with when the hub's server stored that revision."""

    record: RunRecord
    revision: int
    written: float
    """The server's stamp of the revision (its clock, seconds since the epoch)."""


class Runs:
    def __init__(
        self, js: JetStreamContext, kv: KeyValue, writer: KvWriter, bucket: str = names.RUNS_BUCKET
    ) -> None:
        self._js = js
        self._kv = kv
        self._writer = writer
        self._bucket = bucket
        # Hub services only (the dispatcher writes it, the reaper reads and retires).
        self._live = KvWriter(js, names.LIVE_BUCKET)

    @classmethod
    async def open(
        cls, js: JetStreamContext, api_prefix: str | None = None, bucket: str = names.RUNS_BUCKET
    ) -> Runs:
        """`js` reads the hub's domain; `api_prefix` routes writes into it from a site.
        `bucket`: a site's own runs bucket, the records of the runs granted to it
        (`shared.state.grants`), read and written in the site's domain."""
        kv = await js.key_value(bucket)
        return cls(js, kv, KvWriter(js, bucket, api_prefix), bucket)

    async def get(self, run_id: str) -> tuple[RunRecord, int] | None:
        try:
            entry = await self._kv.get(run_id)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        assert entry.value is not None and entry.revision is not None
        return decode(entry.value, RunRecord), entry.revision

    async def stamped(self, run_id: str) -> Stamped | None:
        """As `get` (the same one direct get), with the server's stamp of the revision."""
        try:
            msg = await self._js.get_msg(
                f"KV_{self._bucket}", subject=f"$KV.{self._bucket}.{run_id}", direct=True
            )
        except NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        assert msg.seq is not None
        return Stamped(decode(msg.data, RunRecord), msg.seq, stamp(msg.time))

    async def confirmed(self, run_id: str) -> tuple[RunRecord, int] | None:
        """As `get`, but a record found missing is looked for again by the bucket's leader.
        The bucket allows direct gets, which any replica answers, and a replica still
        catching up (a node just back in a cluster) answers "no such key" for a record the
        dispatcher has just created — seen in the suite under load, as a task
        dead-lettered for want of its record. Only an absence the leader confirms is one."""
        found = await self.get(run_id)
        if found is not None:
            return found
        try:
            msg = await self._js.get_last_msg(f"KV_{self._bucket}", f"$KV.{self._bucket}.{run_id}")
        except NotFoundError:
            return None
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return None
        assert msg.seq is not None
        return decode(msg.data, RunRecord), msg.seq

    async def create(self, record: RunRecord) -> int | None:
        """The record's revision; None when a record with this run id already exists, in the
        runs bucket or in the archive (a run id names one run for ever). The live key is
        written first: a record never exists unseen by the sweep."""
        _, archived = await asyncio.gather(
            self._live.put(record.run_id, b""), archive.find(self._js, record.run_id)
        )
        if archived is not None:
            await self.forget_live(record.run_id)
            return None
        try:
            return await self._kv.create(record.run_id, encode(record))
        except KeyWrongLastSequenceError:
            return None

    async def adopt(self, record: RunRecord) -> bool:
        """Keep `record` as it is, unless the bucket has a record of its run already (a
        site's bucket taking a run granted to it): False then."""
        try:
            await self._kv.create(record.run_id, encode(record))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def find(self, run_id: str) -> RunRecord | None:
        """The run's record, from the runs bucket or else from the archive."""
        found = await self.get(run_id)
        return found[0] if found is not None else await archive.find(self._js, run_id)

    async def update(self, run_id: str, change: Change) -> RunRecord | None:
        """Apply `change` to the newest record until the CAS holds. `change` returns None
        to leave the record alone (the update no longer applies); so does this call."""
        changed = await self.change(run_id, change)
        return changed[0] if changed is not None else None

    async def change(self, run_id: str, change: Change) -> tuple[RunRecord, int] | None:
        """As `update`, with the revision the change was written at."""
        while True:
            found = await self.get(run_id)
            if found is None:
                return None
            record, revision = found
            new = change(record)
            if new is None:
                return None
            new = msgspec.structs.replace(new, updated_at=time.time())
            written = await self._writer.put(run_id, encode(new), expected=revision)
            if written is not None:
                return new, written

    async def live(self) -> list[tuple[str, tuple[RunRecord, int] | None]]:
        """Every run in the live index with its record and revision (None: no record, which
        a submission being dispatched leaves for a moment). Reads no ended, retired run."""
        return [(run_id, await self.get(run_id)) for run_id in await self.live_ids()]

    async def live_stamped(self) -> list[tuple[str, Stamped | None]]:
        """As `live`, each record with the server's stamp of its revision (the same reads)."""
        return [(run_id, await self.stamped(run_id)) for run_id in await self.live_ids()]

    async def live_ids(self) -> list[str]:
        return await keys(self._js, names.LIVE_BUCKET)

    async def retire(self, record: RunRecord, revision: int, keep_s: float) -> bool:
        """Archive an ended run and take it out of the live index; the runs bucket forgets
        it `keep_s` later. False if the record changed since it was read at `revision`."""
        assert record.state.terminal and not record.announce_pending
        await archive.keep(self._js, record)
        # The same record again, with a TTL; the rollup drops its earlier revisions, which
        # would otherwise show through once the TTL removed this one.
        ttl = max(1, round(keep_s))
        written = await self._writer.put(
            record.run_id, encode(record), expected=revision, ttl_s=ttl, rollup=True
        )
        if written is None:
            return False
        await self.forget_live(record.run_id)
        return True

    async def forget_live(self, run_id: str) -> None:
        # A plain delete marker would stay for ever, one per run ever retired, and listing
        # the index reads every subject's last message: the marker goes after a second.
        await self._live.delete(run_id, expected=None, ttl_s=1)

    async def all(self) -> list[RunRecord]:
        """Every record still in the runs bucket (live runs and recently ended ones): reads
        each one, so its cost follows the bucket's size; only `baton runs --all` uses it."""
        out = []
        for key in await keys(self._js, self._bucket):
            found = await self.get(key)
            if found is not None:
                out.append(found[0])
        return out
