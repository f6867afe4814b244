"""How a group of ranks forms (`Forming`, the half of `group.Leader` that does it): its
ranks called for, its members' keys read until every rank is held, and why it waits said in
the record; giving way to an older group of the pool, and giving the task back after
`BATON_FORM_WAIT` for as long again (`group.py` says why, in full)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus import names
from shared.bus.connect import publish
from shared.contracts import Task, encode
from shared.contracts.groups import GroupKey, MemberKey, RankCall
from shared.state import transitions
from shared.state.groups import GroupStore, older_on_either_side
from shared.state.lease import Lease
from shared.state.runs import Runs
from shared.waits import wait_set

log = logging.getLogger("baton.trainer")

POLL_S = 0.5
FORM_POLL_S = 0.1
"""While a group forms, how often its leader reads its members' keys, and a member the
group's key: a group forms, and starts, within this of its last rank being held."""
MAX_FORM_DELAY_S = 600.0
FORM_GRACE_S = 2 * POLL_S
"""An elastic group that holds at least its `min` ranks, but not its `max`, forms once it has
waited this long for more: trainers free now take a call within moments (and one that comes
later is grown onto at once)."""
GIVE_WAY_S = 2.0
"""How long a trainer that gave way keeps its task or call off the queue: long enough that
its next fetch finds the older group's calls first."""


@dataclass(frozen=True)
class Formed:
    members: list[MemberKey]


@dataclass(frozen=True)
class GaveWay:
    reason: str
    delay: float


class Superseded(Exception):
    """The run moved on under this leader: its lease was taken, or a newer group's key
    replaced its own."""


class Forming:
    """The forming of a leader's group (`group.Leader`, which holds all of these)."""

    js: JetStreamContext
    store: GroupStore
    other: GroupStore | None
    """At a site, the other side's groups (`older_on_either_side`)."""
    runs: Runs
    task: Task
    lease: Lease
    worker: str
    site: str
    granted: bool
    ranks: int
    min_ranks: int
    key: GroupKey
    members: list[MemberKey]
    _waiting: str
    _revision: int
    _tries: int

    @property
    def epoch(self) -> int:
        return self.key.epoch

    @property
    def group_key(self) -> str:
        return names.group_key(self.task.spec.pool, self.task.run_id)

    async def renew(self) -> None:
        """Write the group's key again (`Leader.renew`)."""
        raise NotImplementedError

    async def form(self, msg: Msg, stop: asyncio.Event, wait_s: float) -> Formed | GaveWay:
        """Hold the run while its ranks are called for, until every rank is held (Formed),
        or an older group of the pool is forming, `wait_s` passed, or the trainer is asked
        to stop (GaveWay). The lease and the task message are kept alive meanwhile; a lease
        lost, or a newer group's key, raises `Superseded`."""
        self._tries = msg.metadata.num_delivered or 1
        current, revision = await self.store.revision(self.group_key)
        if current is not None and current.epoch > self.epoch:
            raise Superseded()
        self._revision = revision
        await self.renew()
        for rank in range(1, self.ranks):
            await self._call(rank)
        began = last_beat = time.monotonic()
        looked = float("-inf")
        while True:
            # The members' keys every `FORM_POLL_S`, so the group forms the moment its last
            # rank is held; the rest (older groups, the record, the key's renewal) every
            # `POLL_S`.
            held = [m for m in [await self._member(r) for r in range(1, self.ranks)] if m]
            waited = time.monotonic() - began
            if len(held) + 1 == self.ranks or (
                len(held) + 1 >= self.min_ranks and waited >= FORM_GRACE_S
            ):
                return self._formed(held)
            if stop.is_set() or time.monotonic() - looked >= POLL_S:
                looked = time.monotonic()
                gave = await self._give_way(len(held) + 1, waited, wait_s, stop)
                if gave is not None:
                    return gave
                await self._say_waiting(self._why_waiting(len(held) + 1))
                if time.monotonic() - last_beat >= self.lease.ttl_s / 3:
                    last_beat = time.monotonic()
                    await msg.in_progress()
                    if (over := await self._beat()) is not None:
                        return over
                await self.renew()
            await wait_set(stop, FORM_POLL_S)

    async def _call(self, rank: int, grow: bool = False) -> None:
        call = RankCall(task=self.task, epoch=self.epoch, rank=rank, grow=grow)
        # A run granted to the site: into its own work queue. A site trainer leading a run
        # the hub holds: through its outbox, which the hub's work queue sources.
        run_id, pool = self.task.run_id, self.task.spec.pool
        if self.granted:
            subject = names.site_call_subject(self.site, pool, run_id)
        else:
            subject = names.at_site(names.call_subject(pool, run_id), self.site)
        msg_id = names.call_id(run_id, self.epoch, rank, grow)
        await publish(self.js, subject, encode(call), msg_id=msg_id)

    def _formed(self, held: list[MemberKey]) -> Formed:
        """The group as it forms: its ranks are the held slots in order (an elastic group
        may hold slots 1 and 3 of 3), rank 0 the leader."""
        self.members = sorted(held, key=lambda m: m.rank)
        self.ranks = len(self.members) + 1
        self.key = msgspec.structs.replace(self.key, ranks=self.ranks)
        return Formed(self.members)

    def _why_waiting(self, held: int) -> str:
        pool, short = self.task.spec.pool, self.min_ranks - held
        if not self.task.spec.elastic:
            return (
                f"forming a group of {self.ranks}: {held} of {self.ranks} ranks held, "
                f"waiting for {short} more trainer(s) of pool {pool!r}"
            )
        sizes = f"forming a group of {self.min_ranks} to {self.task.spec.max_ranks}"
        if short <= 0:
            return f"{sizes}: {held} rank(s) held, waiting {FORM_GRACE_S:.0f}s for more"
        return (
            f"{sizes}: {held} rank(s) held, fewer than its min of {self.min_ranks}; waiting "
            f"for {short} more trainer(s) of pool {pool!r}"
        )

    async def _give_way(
        self, held: int, waited: float, wait_s: float, stop: asyncio.Event
    ) -> GaveWay | None:
        older = await older_on_either_side(self.key, self.store, self.other)
        if older is not None:
            return GaveWay(f"gave way to the older run {older.run_id}, forming too", GIVE_WAY_S)
        if waited > wait_s:
            # Every try is a delivery of the task, and the work queue gives up on a task
            # after `BATON_MAX_DELIVER` of them: the wait grows with each try, so a group
            # that waits for busy trainers waits hours, not minutes, before that.
            delay = min(wait_s * self._tries, MAX_FORM_DELAY_S)
            return GaveWay(
                f"no group of {self.ranks} formed within {wait_s:.0f}s ({held} of "
                f"{self.ranks} ranks held); trying again in {delay:.0f}s",
                delay,
            )
        if stop.is_set():
            return GaveWay("its trainer is stopping", 0.0)
        return None

    async def _beat(self) -> GaveWay | None:
        """Renew the lease (`Superseded` if it was taken) and read the record's orders."""
        if not await self.lease.renew():
            raise Superseded()
        found = await self.runs.get(self.task.run_id)
        if found is None or found[0].state.terminal:
            return GaveWay("the run is over", 0.0)
        if found[0].cancel_requested is not None:
            return GaveWay("asked to cancel", 0.0)
        return None

    async def _member(self, rank: int) -> MemberKey | None:
        m = await self.store.member(self.task.run_id, self.epoch, rank)
        return m if m is not None and m.state == "joined" else None

    async def _say_waiting(self, why: str) -> None:
        """Tell `baton status` why the run is not training (only when that changes)."""
        if why == self._waiting:
            return
        self._waiting = why
        change = transitions.note_waiting(why, self.lease.token)
        with contextlib.suppress(Exception):  # advisory: the next change says it again
            await self.runs.update(self.task.run_id, change)
