"""Pools: what a step costs, for budgets and deadlines (docs/architecture.md, "Retention and
budgets": a job's cost is estimated before it runs, and its budget caps its hard timeout).

The configured table (`BATON_POOLS_FILE`) gives each pool a rate per hour and a first
guess of seconds per step. Trainers measure real seconds per step on every completed run
and fold them into the `baton_pools` bucket (an exponential moving average, updated by
CAS), which overrides the guess from then on.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import convert, decode, encode
from shared.contracts.jobs import Disconnect, JobSpec, OnFailure
from shared.errors import ConfigError

EWMA_WEIGHT = 0.3
SPEED_FRESH_S = 5.0


class Pool(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rate_per_hour: float = 0.0
    """What an hour of one trainer of this pool costs, in the budget's unit."""
    seconds_per_step: float | None = None
    """Configured first guess; replaced by measurements once runs complete."""
    on_failure: OnFailure = "retry"
    """What a failure of user code leads to for a job that does not say
    (`shared.contracts.jobs.OnFailure`)."""
    disconnect: Disconnect = Disconnect()
    """What the hub does with this pool's runs granted to a site that falls silent, for a
    job that does not say (`shared.contracts.jobs.Disconnect`)."""


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    seconds_per_step: float
    runs: int


class PoolTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pools: dict[str, Pool] = {}


def disconnect_of(spec: JobSpec, table: PoolTable) -> Disconnect:
    """The disconnect policy in force for a run: its job's, else its pool's, else the
    default."""
    if spec.disconnect is not None:
        return spec.disconnect
    pool = table.pools.get(spec.pool)
    return pool.disconnect if pool is not None else Disconnect()


def load_table(path: str) -> PoolTable:
    if not path:
        return PoolTable()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read pool table {path}: {exc}") from None
    return convert(raw, PoolTable)


class Pools:
    def __init__(
        self, js: JetStreamContext, table: PoolTable, api_prefix: str | None = None
    ) -> None:
        self.js = js
        self.table = table
        self._writer = KvWriter(js, names.POOLS_BUCKET, api_prefix)
        self._kv: KeyValue | None = None
        self._speeds: dict[str, tuple[float | None, float]] = {}  # pool -> (s/step, read at)

    def policy(self, pool: str) -> OnFailure:
        """The pool's failure policy, for the jobs that set none."""
        return self.table.pools.get(pool, Pool()).on_failure

    def rate(self, pool: str) -> float:
        return self.table.pools.get(pool, Pool()).rate_per_hour

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
            speed = self.table.pools.get(pool, Pool()).seconds_per_step
        else:
            assert entry.value is not None
            speed = decode(entry.value, Measured).seconds_per_step
        self._speeds[pool] = (speed, now)
        return speed

    async def record(self, pool: str, seconds_per_step: float) -> None:
        """Fold one completed run's measured speed into the pool's average."""
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
