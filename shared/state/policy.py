"""The pools' configuration as it stands now, shared by every service through the hub.

Invariant: one version of the pools' table is in force at a time — the newest one applied
to the `baton_policy` bucket (key `pools`) — and every service reads it there, so a change
applied once (`baton pools apply FILE`, or an edit of the dispatcher's `BATON_POOLS_FILE`,
which it re-applies when the file changes) reaches every service without a restart.

Reads are direct gets by key, at most one every `FRESH_S` per process (`Policy.current`):
cheap enough for every scheduling pass, and the same from a site (a direct get crosses the
leaf into the hub's domain; a watch would need a push consumer across the link). Until the
bucket holds a table, a service uses the one its own `BATON_POOLS_FILE` names (or
defaults): what every service did before the table was shared.
"""

from __future__ import annotations

import hashlib
import logging
import time
import tomllib
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import convert, decode, encode
from shared.contracts.jobs import Disconnect, JobSpec
from shared.contracts.pools import PoolTable
from shared.errors import ConfigError, ContractError

log = logging.getLogger("baton.policy")

KEY = "pools"
FRESH_S = 2.0
"""How old a process's copy of the table may be: a change takes effect within this long."""


def load_table(path: str) -> PoolTable:
    """The TOML file at `path` as a table (none: the defaults); `ConfigError` naming the
    field for a bad one."""
    if not path:
        return PoolTable()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read pool table {path}: {exc}") from None
    try:
        return convert(raw, PoolTable)
    except ContractError as exc:
        raise ConfigError(f"pool table {path}: {exc}") from None


def disconnect_of(spec: JobSpec, table: PoolTable) -> Disconnect:
    """The disconnect policy in force for a run: its job's, else its pool's, else the
    default."""
    if spec.disconnect is not None:
        return spec.disconnect
    return table.pool(spec.pool).disconnect


class Policy:
    """A process's view of the table in force (`current`), read through `js` (the hub's
    domain; `api_prefix` routes writes there from a site)."""

    def __init__(
        self, js: JetStreamContext, fallback: PoolTable, api_prefix: str | None = None
    ) -> None:
        self.js = js
        self.fallback = fallback
        self.table = fallback
        """The newest table read; the fallback until the bucket holds one."""
        self.revision = 0
        self._read_at = float("-inf")
        self._writer = KvWriter(js, names.POLICY_BUCKET, api_prefix)

    async def current(self, max_age_s: float = FRESH_S) -> PoolTable:
        """The table in force, read again once `max_age_s` passed (a failed read keeps the
        last one: a hub electing a leader must not stop a scheduling pass)."""
        if time.monotonic() - self._read_at >= max_age_s:
            try:
                await self.refresh()
            except Exception as exc:
                log.debug("the pools' table could not be read (%r); keeping the last", exc)
        return self.table

    async def refresh(self) -> None:
        self._read_at = time.monotonic()
        try:
            msg = await self.js.get_msg(
                f"KV_{names.POLICY_BUCKET}", subject=f"$KV.{names.POLICY_BUCKET}.{KEY}",
                direct=True,
            )  # fmt: skip
        except (NotFoundError, KeyNotFoundError):
            return
        if not msg.data or msg.seq is None or msg.seq == self.revision:
            return
        try:
            self.table = decode(msg.data, PoolTable)
        except ContractError as exc:  # written by a newer Baton: keep what we understand
            log.warning("the pools' table in force cannot be read here: %s", exc)
            return
        self.revision = msg.seq

    async def apply(self, table: PoolTable) -> bool:
        """Put `table` in force for every service; False when it already was."""
        await self.refresh()
        if self.revision and digest(self.table) == digest(table):
            return False
        written = await self._writer.put(KEY, encode(table))
        if written is not None:
            self.table, self.revision = table, written
            self._read_at = time.monotonic()
        return True


def digest(table: PoolTable) -> str:
    return hashlib.sha256(encode(table)).hexdigest()


class PoolsFile:
    """The dispatcher's `BATON_POOLS_FILE`, applied at start and again whenever its content
    changes (checked every `FRESH_S`): an edit takes effect without a restart. A file that
    no longer parses is logged and left out; the table in force stays."""

    def __init__(self, path: str, policy: Policy) -> None:
        self.path = path
        self.policy = policy
        self._seen: bytes | None = None

    async def check(self) -> None:
        if not self.path:
            return
        try:
            data = Path(self.path).read_bytes()
        except OSError as exc:
            if self._seen is not None:
                log.warning("pools file %s cannot be read (%s); the table in force stays",
                            self.path, exc)  # fmt: skip
            self._seen = b""
            return
        if data == self._seen:
            return
        try:
            table = load_table(self.path)
        except ConfigError as exc:
            self._seen = data  # said once; the next edit is read again
            log.error("%s; the table in force stays", exc)
            return
        applied = await self.policy.apply(table)  # raises while the hub cannot answer
        self._seen = data
        if applied:
            log.info("pools file %s applied (revision %d)", self.path, self.policy.revision)
