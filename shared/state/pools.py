"""Pools: what a step costs, for budgets and deadlines (docs/architecture.md, "Retention and
budgets": a job's cost is estimated before it runs, and its budget caps its hard timeout).

The configured table (`BATON_POOLS_FILE`) gives each pool a rate per hour and a first
guess of seconds per step. Trainers measure real seconds per step on every completed run
and fold them into the `baton_pools` bucket (an exponential moving average, updated by
CAS), which overrides the guess from then on.
"""

from __future__ import annotations

import hashlib
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import decode, encode
from shared.contracts.jobs import OnFailure
from shared.state.policy import Policy

EWMA_WEIGHT = 0.3
SPEED_FRESH_S = 5.0


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    seconds_per_step: float
    runs: int


class JobSpeeds(msgspec.Struct, frozen=True, kw_only=True):
    """The seconds per step of the last `JOB_SAMPLES` completed runs of one job name in a
    pool, newest last: what a prepaid run's estimate takes the median of."""

    samples: list[float] = []


JOB_SAMPLES = 15


def job_key(pool: str, name: str) -> str:
    """The key of a job name's speeds in the pools bucket (a name may hold any character;
    a key may not)."""
    return f"job.{pool}.{hashlib.sha256(name.encode()).hexdigest()[:20]}"


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class Pools:
    def __init__(self, js: JetStreamContext, policy: Policy, api_prefix: str | None = None) -> None:
        self.js = js
        self.policy = policy
        """The pools' table in force (`shared.state.policy`)."""
        self._writer = KvWriter(js, names.POOLS_BUCKET, api_prefix)
        self._kv: KeyValue | None = None
        self._speeds: dict[str, tuple[float | None, float]] = {}  # pool -> (s/step, read at)

    def on_failure(self, pool: str) -> OnFailure:
        """The pool's failure policy, for the jobs that set none."""
        return self.policy.table.pool(pool).on_failure

    def rate(self, pool: str) -> float:
        return self.policy.table.pool(pool).rate_per_hour

    async def seconds_per_step(self, pool: str) -> float | None:
        """The measured speed (else the configured guess), read at most every
        `SPEED_FRESH_S`: an estimate changes with each completed run, slowly, and the
        dispatcher asks once per submission."""
        now = time.monotonic()
        cached = self._speeds.get(pool)
        if cached is not None and now - cached[1] < SPEED_FRESH_S:
            return cached[0]
        if self._kv is None:
            self._kv = await self.js.key_value(names.POOLS_BUCKET)
        try:
            entry = await self._kv.get(pool)
        except KeyNotFoundError:
            speed = self.policy.table.pool(pool).seconds_per_step
        else:
            assert entry.value is not None
            speed = decode(entry.value, Measured).seconds_per_step
        self._speeds[pool] = (speed, now)
        return speed

    async def job_step_s(self, pool: str, name: str) -> float | None:
        """The median seconds per step of the last completed runs of job `name` in `pool`;
        None before one completed."""
        if self._kv is None:
            self._kv = await self.js.key_value(names.POOLS_BUCKET)
        try:
            entry = await self._kv.get(job_key(pool, name))
        except KeyNotFoundError:
            return None
        assert entry.value is not None
        return median(decode(entry.value, JobSpeeds).samples)

    async def record(self, pool: str, seconds_per_step: float, name: str = "") -> None:
        """Fold one completed run's measured speed into the pool's average, and into the
        last samples of its job `name`."""
        await self._fold(pool, seconds_per_step)
        if name:
            await self._sample(job_key(pool, name), seconds_per_step)

    async def _sample(self, key: str, seconds_per_step: float) -> None:
        kv = await self.js.key_value(names.POOLS_BUCKET)
        for _ in range(5):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                first = JobSpeeds(samples=[seconds_per_step])
                if await self._writer.put(key, encode(first), expected=0) is not None:
                    return
                continue
            assert entry.value is not None and entry.revision is not None
            old = decode(entry.value, JobSpeeds).samples
            new = JobSpeeds(samples=[*old, seconds_per_step][-JOB_SAMPLES:])
            if await self._writer.put(key, encode(new), expected=entry.revision) is not None:
                return

    async def _fold(self, pool: str, seconds_per_step: float) -> None:
        kv = await self.js.key_value(names.POOLS_BUCKET)
        for _ in range(5):
            try:
                entry = await kv.get(pool)
            except KeyNotFoundError:
                first = Measured(seconds_per_step=seconds_per_step, runs=1)
                if await self._writer.put(pool, encode(first), expected=0) is not None:
                    return
                continue
            assert entry.value is not None and entry.revision is not None
            old = decode(entry.value, Measured)
            new = Measured(
                seconds_per_step=(1 - EWMA_WEIGHT) * old.seconds_per_step
                + EWMA_WEIGHT * seconds_per_step,
                runs=old.runs + 1,
            )
            if await self._writer.put(pool, encode(new), expected=entry.revision) is not None:
                return
