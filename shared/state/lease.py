"""Run leases in a KV bucket, with the acquiring write's revision as the fencing token.

Every write is a raw JetStream publish to the bucket's subject, carrying
`Nats-Expected-Last-Subject-Sequence` (the compare-and-swap) and `Nats-TTL` (expiry by the
*server's* clock, so no two hosts' clocks ever need to agree). nats-py's `kv.update()` can do
neither TTL on update nor writes from a leaf into the hub's domain (docs/nats.md), so we do
not use it for writes. `api_prefix` (e.g. `$JS.hub.API`) routes the writes into another
JetStream domain.

Revisions of one stream only grow, so a lease taken over after expiry always carries a
higher token than the one it replaces — which is what the store's pointer CAS orders by.

A lease that expires leaves, for a second, a marker the server writes in its place (the
bucket's `limit_marker_ttl`): an entry with no value, which nats-py's `get` returns like a
value. Every read here counts an empty entry as no lease. The marker is what the reaper
watches to hand a run over the moment its lease lapses (`services/reaper/lapses.py`).

With a lease secret (`BATON_LEASE_SECRET`, hub services only), a run's lease lives under a
key derived from it (`lease_key`), which the dispatcher hands out in the run's tasks. A
trainer may only read and write leases by exact key (`shared.auth`): it cannot list them,
so it can name — and write — only the leases of the runs it was handed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import encode
from shared.state.grants import epoch_of, token_of

log = logging.getLogger("baton.lease")


def lease_key(run_id: str, secret: bytes | None) -> str:
    """Where a run's lease lives: the run id, suffixed with a MAC of it under the hub's
    lease secret when there is one."""
    if not secret:
        return run_id
    return f"{run_id}.{hmac.new(secret, run_id.encode(), hashlib.sha256).hexdigest()[:32]}"


def run_of_key(key: str, secret: bytes | None) -> str | None:
    """The run whose lease lives under `key`, or None if `key` is no run's lease key."""
    run_id = key.rpartition(".")[0] if secret else key
    return run_id if run_id and lease_key(run_id, secret) == key else None


class Lease:
    def __init__(
        self,
        js: JetStreamContext,
        run_id: str,
        worker: str,
        ttl_s: int,
        api_prefix: str | None = None,
        key: str | None = None,
        *,
        bucket: str = names.LEASES_BUCKET,
        epoch: int = 0,
    ) -> None:
        """`bucket`: a site's own leases bucket for a run granted to it; `epoch`: the run's
        grant epoch, the high bits of every token (`shared.state.grants`)."""
        self._js = js
        self._bucket = bucket
        self.epoch = epoch
        self.run_id = run_id
        self.key = key or run_id
        """The lease's key in the bucket (`lease_key`)."""
        self.worker = worker
        self.ttl_s = ttl_s
        self._writer = KvWriter(js, bucket, api_prefix)
        self.token = 0
        """The fencing token: the revision of the write that acquired the lease, under the
        run's grant epoch (`grants.token_of`)."""
        self.revision = 0
        """Revision of the newest write (acquire or renew): what the next CAS expects."""

    async def acquire(self) -> bool:
        """Take the lease if nobody holds it. False when another holder's lease is alive."""
        expected = 0
        for _ in range(3):
            seq = await self._write(expected)
            if seq is not None:
                self.token, self.revision = token_of(self.epoch, seq), seq
                return True
            free = await self._free_revision()
            if free is None:
                return False
            expected = free
        return False

    async def renew(self) -> bool:
        """Extend the lease. False means it was lost: expired, or taken by someone else.

        A renewal that raised may still have landed (its answer lost while a clustered
        hub elected a new leader), so the next one's CAS fails on our own write: the lease
        is still ours when it names this worker and token, and is renewed from there."""
        seq = await self._write(self.revision)
        if seq is None:
            ours = await self._still_ours()
            seq = await self._write(ours) if ours is not None else None
            if seq is None:
                return False
        self.revision = seq
        return True

    async def _still_ours(self) -> int | None:
        """The lease's revision if it is alive and names this worker and token."""
        kv = await self._js.key_value(self._bucket)
        try:
            entry = await kv.get(self.key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        held = json.loads(entry.value or b"{}")
        if held.get("worker") != self.worker or held.get("token") != self.token:
            return None
        log.info("%s: a renewal not heard of had landed; the lease is still ours", self.run_id)
        return entry.revision

    async def release(self) -> None:
        """Give the lease up now, so the next worker need not wait for the TTL. A renewal
        whose reply was lost may have moved the revision on; the lease is then still ours
        (it names this worker) and is released at its real revision."""
        kv = await self._js.key_value(self._bucket)
        for _ in range(2):
            if await self._writer.delete(self.key, expected=self.revision):
                return
            try:
                entry = await kv.get(self.key)
            except (KeyNotFoundError, KeyDeletedError):
                return  # lapsed or released already
            holder = json.loads(entry.value or b"{}").get("worker")
            if entry.revision is None or holder != self.worker:
                log.info("%s: lease no longer ours on release", self.run_id)
                return
            self.revision = entry.revision

    async def abandon(self, token: int) -> bool:
        """Free the lease that a dead predecessor under this worker identity took at
        `token`: only while it still names this worker and that token. The acquiring write
        is the token itself (its value names token 0); every renewal writes the token."""
        kv = await self._js.key_value(self._bucket)
        try:
            entry = await kv.get(self.key)
        except (KeyNotFoundError, KeyDeletedError):
            return False  # lapsed already
        held = json.loads(entry.value or b"{}")
        assert entry.revision is not None
        named = held.get("token") or token_of(self.epoch, entry.revision)
        if held.get("worker") != self.worker or named != token:
            return False
        return await self._writer.delete(self.key, expected=entry.revision)

    async def _write(self, expected: int) -> int | None:
        value = encode({"worker": self.worker, "token": self.token})
        return await self._writer.put(self.key, value, expected=expected, ttl_s=self.ttl_s)

    async def _free_revision(self) -> int | None:
        """The revision a create must name: 0 if the key never existed or expired, the
        marker's revision if it was released, None if someone holds it."""
        kv = await self._js.key_value(self._bucket)
        try:
            entry = await kv.get(self.key)
        except (KeyDeletedError, KeyNotFoundError) as exc:
            # nats-py reports a released key (a delete marker) as KeyNotFoundError carrying
            # the marker's entry; a create must name that revision to pass the CAS.
            marker = getattr(exc, "entry", None)
            return int(marker.revision) if marker is not None and marker.revision else 0
        if not entry.value and entry.revision:
            return int(entry.revision)  # the server's expiry marker (see the module's docstring)
        return None


async def holder(js: JetStreamContext, key: str) -> str | None:
    """The worker holding the lease under `key` (`lease_key`), or None when nobody does."""
    kv = await js.key_value(names.LEASES_BUCKET)
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    if not entry.value:
        return None  # the server's expiry marker (see the module's docstring)
    try:
        return str(json.loads(entry.value or b"{}").get("worker", "?"))
    except ValueError:
        return "?"


async def free(js: JetStreamContext, key: str, worker: str, token: int) -> bool:
    """Free the hub lease under `key` for a holder known dead or cut off — only while it
    still names `worker` and `token`. True if this call freed it."""
    kv = await js.key_value(names.LEASES_BUCKET)
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return False  # lapsed or released already
    if not entry.value or entry.revision is None:
        return False  # the server's expiry marker
    held = json.loads(entry.value)
    named = held.get("token") or token_of(epoch_of(token), entry.revision)
    if held.get("worker") != worker or named != token:
        return False  # taken by another attempt since
    return await KvWriter(js, names.LEASES_BUCKET).delete(key, expected=entry.revision)


async def is_held(js: JetStreamContext, key: str) -> bool:
    return await holder(js, key) is not None
