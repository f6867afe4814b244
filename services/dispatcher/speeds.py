"""The measured speeds grants by time reckon with (`shared.scheduling.horizon`).

Invariant: what a pass reads of a job's speed is the median the pools bucket held for its
name (`shared.state.pools.JobSpeeds`) at most `FRESH_S` ago, or nothing — never a guess:
a job without one is reckoned from its `estimate_s`, else counts half the horizon. Read
only for the pools some linked site is granted by time, only for the job names queued or
held at a site, so a hub granting by count reads nothing.
"""

from __future__ import annotations

import contextlib
import time

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from services.dispatcher.queues import Reckoner
from shared.bus import names
from shared.contracts import decode
from shared.state.pools import JobSpeeds, job_key, median

FRESH_S = 15.0
"""How long a job's speed read stands: it moves only as its runs complete."""
MOST_READS = 64
"""Job names read in one pass, at most (the rest in the passes after)."""


class Speeds:
    def __init__(self, js: JetStreamContext, reckoner: Reckoner) -> None:
        self.js = js
        self.reckoner = reckoner
        self._kv: KeyValue | None = None
        self._read: dict[tuple[str, str], float] = {}
        """(pool, job) → when its speed was last read."""

    async def refresh(self, pool: str) -> None:
        """Read again the speeds of `pool`'s job names not read within `FRESH_S`."""
        now = time.monotonic()
        jobs = set(self.reckoner.queued_jobs(pool))
        jobs |= {r.spec.name for r in self.reckoner.records_of(pool) if r.site}
        stale = [j for j in sorted(jobs) if now - self._read.get((pool, j), -FRESH_S) >= FRESH_S]
        known = self.reckoner.speeds[pool]
        for job in stale[:MOST_READS]:
            self._read[(pool, job)] = now
            with contextlib.suppress(Exception):  # advisory: read again next time
                found = await self._speed(pool, job)
                if found is None:
                    known.pop(job, None)
                else:
                    known[job] = found
        for key in [k for k in self._read if k[0] == pool and k[1] not in jobs]:
            del self._read[key]
            known.pop(key[1], None)

    async def _speed(self, pool: str, job: str) -> float | None:
        if self._kv is None:
            self._kv = await self.js.key_value(names.POOLS_BUCKET)
        try:
            entry = await self._kv.get(job_key(pool, job))
        except KeyNotFoundError:
            return None
        return median(decode(entry.value or b"", JobSpeeds).samples)
