"""The groups bucket (`baton_groups`): a run's group key and its ranks' member keys.

Every key carries a server-side TTL and is renewed by its one writer, so a key that is gone
means its writer died or went silent (`services/trainer/group.py` says who writes what).
Writes are raw publishes (`shared.bus.kvwrite`), so a site's trainer holds a rank the same
way a hub's does.
"""

from __future__ import annotations

import contextlib
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.contracts import decode, encode
from shared.contracts.groups import GroupKey, MemberKey
from shared.errors import ContractError

_K = TypeVar("_K", GroupKey, MemberKey)


def key_ttl(lease_ttl_s: int) -> int:
    """Seconds a group's or member's key lives unrenewed: a third of the lease TTL, so a
    clustered hub's longer TTL (elections) stretches it alike, and at least 2 s."""
    return max(2, lease_ttl_s // 3)


class GroupStore:
    """The groups bucket as one trainer reads and writes it (across domains from a site)."""

    def __init__(
        self, js: JetStreamContext, api_prefix: str | None, ttl_s: int,
        bucket: str = names.GROUPS_BUCKET,
    ) -> None:  # fmt: skip
        """`bucket`: a site's own (`names.site_groups_bucket`) for the runs granted to it."""
        self._js = js
        self._name = bucket
        self._writer = KvWriter(js, bucket, api_prefix)
        self.ttl_s = ttl_s
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self._js.key_value(self._name)
        return self._kv

    async def put(self, key: str, value: GroupKey | MemberKey) -> None:
        await self._writer.put(key, encode(value), ttl_s=self.ttl_s)

    async def write(self, key: str, value: GroupKey, expected: int) -> int | None:
        """Write `value` if the key is still at revision `expected`; its new revision."""
        return await self._writer.put(key, encode(value), expected=expected, ttl_s=self.ttl_s)

    async def revision(self, key: str) -> tuple[GroupKey | None, int]:
        """The group's key and its revision (that of a delete marker, 0 if none)."""
        try:
            entry = await (await self._bucket()).get(key)
        except (KeyNotFoundError, KeyDeletedError) as exc:
            marker = getattr(exc, "entry", None)
            return None, int(marker.revision) if marker is not None and marker.revision else 0
        return _decode(entry.value, GroupKey), int(entry.revision or 0)

    async def claim(self, key: str, value: MemberKey) -> bool:
        """Write `value` unless a live key names another worker (a rank is held once)."""
        expected = 0
        try:
            entry = await (await self._bucket()).get(key)
        except (KeyNotFoundError, KeyDeletedError) as exc:
            marker = getattr(exc, "entry", None)
            expected = int(marker.revision) if marker is not None and marker.revision else 0
        else:
            held = _decode(entry.value, MemberKey)
            if held is not None and held.worker != value.worker:
                return False
            expected = int(entry.revision or 0)
        written = await self._writer.put(key, encode(value), expected=expected, ttl_s=self.ttl_s)
        return written is not None

    async def delete(self, key: str, expected: int | None = None) -> None:
        with contextlib.suppress(Exception):  # it expires by itself anyway
            await self._writer.delete(key, expected=expected, ttl_s=self.ttl_s)

    async def group(self, pool: str, run_id: str) -> GroupKey | None:
        return await self._get(names.group_key(pool, run_id), GroupKey)

    async def member(self, run_id: str, epoch: int, rank: int) -> MemberKey | None:
        return await self._get(names.member_key(run_id, epoch, rank), MemberKey)

    async def member_revision(
        self, run_id: str, epoch: int, rank: int
    ) -> tuple[MemberKey | None, int]:
        """A member's key and its revision, which grows with every renewal."""
        try:
            entry = await (await self._bucket()).get(names.member_key(run_id, epoch, rank))
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        return _decode(entry.value, MemberKey), int(entry.revision or 0)

    async def older_forming(self, mine: GroupKey) -> GroupKey | None:
        """An older group of `mine`'s pool still forming, which `mine` must give way to."""
        for other in await self._pool_groups(mine.pool):
            if other.run_id != mine.run_id and not other.formed and other.older_than(mine):
                return other
        return None

    async def others_forming(self, pool: str, run_id: str) -> bool:
        """Whether a group of `pool` other than `run_id`'s is forming: a trainer free to
        grow an elastic group joins that one first."""
        return any(g.run_id != run_id and not g.formed for g in await self._pool_groups(pool))

    async def _pool_groups(self, pool: str) -> list[GroupKey]:
        # A watch filtered by the server (nats-py's `keys(filters=…)` reads every key of the
        # bucket and filters by substring); it ends once it has delivered what is there.
        watcher = await (await self._bucket()).watch(
            names.groups_of_pool(pool), ignore_deletes=True
        )
        found = []
        try:
            async for entry in watcher:
                if entry is None:
                    break
                if (group := _decode(entry.value, GroupKey)) is not None:
                    found.append(group)
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        return found

    async def _get(self, key: str, kind: type[_K]) -> _K | None:
        try:
            entry = await (await self._bucket()).get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        return _decode(entry.value, kind)


def _decode(data: bytes | None, kind: type[_K]) -> _K | None:
    if not data:
        return None
    try:
        return decode(data, kind)
    except ContractError:
        return None


async def older_on_either_side(
    mine: GroupKey, own: GroupStore, other: GroupStore | None
) -> GroupKey | None:
    """An older group of `mine`'s pool still forming, in its own side's bucket (`own`) or,
    for a trainer at a site, the other side's (`other`: a site's trainers serve the groups
    granted to it and the hub's alike, so a group on one side gives way to an older one on
    the other, whichever side holds it). The other side's bucket unreadable — the hub's,
    during a cut — holds nothing to give way to: no group of the hub's forms at a cut-off
    site."""
    older = await own.older_forming(mine)
    if older is not None or other is None:
        return older
    try:
        return await other.older_forming(mine)
    except Exception:  # a cut, a hub that does not answer: as good as no group there
        return None
