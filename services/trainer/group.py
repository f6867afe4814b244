"""Groups of ranks: forming one without deadlock, and noticing within seconds that it broke.

A run of N ranks has one task, like any run. The trainer that takes it leads the group as
rank 0 (`Leader`): it takes the run's lease — whose token is the group's **epoch** — writes
the group's key, and publishes one `RankCall` per other rank on the pool's work queue. An
idle trainer that takes a call joins as that rank (`services/trainer/rank.py`) and keeps a
member key. Once every rank is held, rank 0's process opens the group's store and the leader
writes its address into the group's key; the members start their processes from it. A
partly formed group never trains.

**Priority.** Groups of one pool compete for its trainers. Two groups that each hold some
of the trainers the other needs would wait for ever, so the older run (earlier submission,
then run id) always wins: a trainer leading or joining a forming group gives way the moment
it sees an older group of its pool still forming (at a site, on either side: a group
granted to the site and one the hub holds compete for the site's trainers alike) — the
leader gives its task back for a moment, a member hands its call back — and so joins the
older one on its next fetch. The
oldest forming group only ever gains trainers, so some group always forms. A group that
cannot form at all (more ranks than the pool has trainers) gives its leader back after
`BATON_FORM_WAIT` for as long again, so it never keeps the pool from other work.

**Liveness.** Every key has a server-side TTL of a third of the lease TTL (at least 2 s),
renewed by its writer twice as often. The leader reads its members' keys every half second:
a key gone means that rank's trainer died or went silent; a key that says its process exited
tells how; a member trainer whose process died is known at once, as nothing listens on its
alive subject any more (`shared.bus.probe`, hub trainers). Members read the group's key:
gone, or naming another epoch, means the group is over and their process is killed at
once. So a rank lost is noticed in seconds, whatever torch.distributed's own timeout says,
and no rank's process outlives its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext

from services.trainer.faults import SILENT
from services.trainer.forming import POLL_S, Forming, Superseded
from shared.bus import names, probe
from shared.bus.emit import emit
from shared.contracts import RunRecord, Task
from shared.contracts.child import EXIT_GROUP_BROKEN, EXIT_USER_ERROR
from shared.contracts.events import GroupFormed, Resized
from shared.contracts.groups import GroupKey, MemberKey
from shared.state.groups import GroupStore
from shared.state.lease import Lease
from shared.state.runs import Runs
from shared.waits import still_wanted

log = logging.getLogger("baton.trainer")

SILENT_S = 3 * POLL_S
"""A member whose key was not renewed for this long, once its group broke, is taken for
lost without waiting for the key's TTL."""


@dataclass(frozen=True)
class Breakage:
    """Why a group stopped, decided once every rank's end is known (`Leader.settle`)."""

    rank: int
    worker: str
    reason: str
    user: bool
    """The user's code failed in `rank` (a retry counts); otherwise the group lost a rank."""
    tail: str = ""


class Leader(Forming):
    """Rank 0's trainer: forms the group under its lease, then watches its members."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        store: GroupStore,
        runs: Runs,
        task: Task,
        lease: Lease,
        record: RunRecord,
        worker: str,
        addr: str,
        site: str = "",
        granted: bool = False,
        other: GroupStore | None = None,
    ) -> None:
        """`granted`: the run is granted to `site`, so its group forms there (`store` is the
        site's, its calls go into the site's own work queue). `other`: at a site, the other
        side's groups, whose older forming ones this group gives way to as to its own."""
        self.nc = nc
        self.js = js
        self.store = store
        self.other = other
        self.runs = runs
        self.task = task
        self.lease = lease
        self.worker = worker
        self.site = site
        self.granted = granted
        self.cap = min(task.spec.max_ranks, record.ranks_cap or task.spec.max_ranks)
        """The most ranks the scheduler lets an elastic run hold now (its `max` otherwise):
        what it calls for while forming and grows up to (`allow`)."""
        self.ranks = self.cap
        """The group's size: the most it may have while forming, what it has once formed."""
        self.min_ranks = task.spec.min_ranks
        self.prior = record
        """The run's record when this leader took it: the size it trained with last, and the
        step it resumes from."""
        self.key = GroupKey(
            run_id=task.run_id, pool=task.spec.pool, epoch=lease.token, ranks=self.ranks,
            leader=worker, priority=record.created_at, addr=addr,
        )  # fmt: skip
        self.members: list[MemberKey] = []
        self.broken = asyncio.Event()
        """Set when a member is lost or its process ended before the group finished."""
        self.grow = asyncio.Event()
        """Set when a trainer holds the growth call of an elastic group training below its
        `max`: the attempt stops at its next step boundary, and the group forms again."""
        self.grower = ""
        self.grow_slot = 0
        """The slot of this group's growth call, once it trains below its `max`."""
        self.breakage: Breakage | None = None
        self._waiting = ""
        self._revision = 0
        self._writing = asyncio.Lock()
        """One write of the group's key at a time: `watch` renews it from the launch on,
        and `go` writes the port into it meanwhile (each write names the last revision)."""
        """Of this leader's last write of the group's key: every write is a compare-and-swap
        on it, so a leader whose group was replaced (a zombie) can never overwrite or delete
        the newer group's key."""
        self._tries = 1
        """Deliveries of the run's task so far (`form` gives it back this often)."""
        self._growing: asyncio.Task[None] | None = None

    def rendezvous_hosts(self) -> list[str]:
        return [socket.gethostname(), *(m.host for m in self.members)]

    # -- training --------------------------------------------------------------------------

    async def go(self, port: int) -> None:
        """Rank 0's process listens on `port`: let the members start theirs."""
        self.key = msgspec.structs.replace(
            self.key, port=port, members=[self.worker, *(m.worker for m in self.members)],
            hosts=self.rendezvous_hosts(),
        )  # fmt: skip
        try:
            await self.renew()
        except Superseded:  # a zombie: the members follow the newer group's key, not ours
            self._supersede()
            return
        formed = GroupFormed(
            run_id=self.task.run_id, worker=self.worker, epoch=self.epoch, members=self.key.members
        )
        await emit(self.js, formed, site=self.site)
        log.info("%s: group of %d formed, epoch %d: %s", self.task.run_id, self.ranks,
                 self.epoch, ", ".join(self.key.members))  # fmt: skip
        await self._offer_growth()

    async def _offer_growth(self) -> None:
        """A group training below its cap offers one more slot: a growth call, taken only by
        a trainer no other work wants (`rank.py`). One offer at a time."""
        if self.ranks >= self.cap or self.grow_slot:
            return
        held = {m.rank for m in self.members}
        self.grow_slot = min(r for r in range(1, self.task.spec.max_ranks) if r not in held)
        await self._call(self.grow_slot, grow=True)

    def allow(self, record: RunRecord) -> None:
        """The run's record as the lease keeper read it: a cap the scheduler raised lets
        the group grow now (a cap lowered is a shrink, which the record's `preempt` asks)."""
        cap = min(self.task.spec.max_ranks, record.ranks_cap or self.task.spec.max_ranks)
        if cap <= self.cap:
            return
        self.cap = cap
        if self.key.port and not self.grow_slot:
            self._growing = asyncio.create_task(self._offer_growth())

    def resized(self, step: int) -> Resized | None:
        """The event of an elastic group formed at another size than its run trained with
        last, resuming at `step`; None if it did not change."""
        before = self.prior.group_size
        if not self.task.spec.elastic or not before or before == self.ranks:
            return None
        pool, most = self.task.spec.pool, self.task.spec.max_ranks
        reason = (
            f"{self.ranks - before} more trainer(s) of pool {pool!r} free"
            if self.ranks > before
            else f"{self.ranks} of at most {most} ranks held: no spare trainer of pool "
            f"{pool!r} was free"
        )
        return Resized(
            run_id=self.task.run_id, worker=self.worker, epoch=self.epoch, from_ranks=before,
            to_ranks=self.ranks, reason=reason, step=step,
        )  # fmt: skip

    async def watch(self) -> None:
        """Renew the group's key and read the members' until one is lost or its process
        ends; then set `broken`. Runs for the whole attempt, from the launch of rank 0's
        process (cancelled at its end): that process imports the user's code before it
        reports its port (`go`), which may take longer than the key's TTL."""
        while True:
            still_wanted()  # a member's read may have swallowed its cancellation (`waits`)
            try:
                await self.renew()
            except Superseded:
                self._supersede()
                return
            except Exception:  # a blip: the keys outlive a few misses
                await asyncio.sleep(POLL_S)
                continue
            with contextlib.suppress(Exception):
                for m in self.members:
                    now = await self.store.member(self.task.run_id, self.epoch, m.rank)
                    cause = _cause(m, now, self._rank_of(m))
                    if cause is not None and self.breakage is None:
                        self.breakage = cause
                        self.broken.set()
                if self.grow_slot and not self.grow.is_set():
                    offer = await self._member(self.grow_slot)
                    if offer is not None:
                        self.grower = offer.worker
                        self.grow.set()
            await asyncio.sleep(POLL_S)

    async def settle(self, own_code: int, own_tail: str) -> Breakage:
        """Once rank 0's process has ended: wait until every member's end is known — its key
        says its process exited, or its trainer is silent (the key gone, or not renewed for
        `SILENT_S`) — then say why the group stopped. A rank lost outweighs a user failure
        (the user's code may have failed only because a peer vanished); a user failure
        outweighs a collective that merely failed."""
        ends = await self._ends()
        causes = [
            c for m in self.members
            if (c := _cause(m, ends.get(m.rank, m), self._rank_of(m))) is not None
        ]  # fmt: skip
        if self.breakage is not None:
            causes.insert(0, self.breakage)
        lost = [c for c in causes if not c.user and c.reason != _PEER_FAILED]
        if lost:
            return lost[0]
        if own_code == EXIT_USER_ERROR:
            causes.insert(0, Breakage(0, self.worker, "rank 0's code failed", True, own_tail))
        users = [c for c in causes if c.user]
        if users:
            return users[0]
        return Breakage(0, self.worker, "a collective failed (a peer was too slow)", False)

    async def _ends(self) -> dict[int, MemberKey | None]:
        """How each member ended: its exited key, or None for a silent trainer. A dead
        trainer's key outlives it by up to its TTL; it is known silent sooner, once its
        revision stops moving (a live one renews it every `POLL_S`), and at once when a
        probe finds its connection gone. At most a key's TTL."""
        # A member trainer whose process died is known at once: nothing listens on its
        # alive subject any more (`shared.bus.probe`). At the hub only: a site's trainers
        # are not heard across its link.
        probes = {
            m.rank: asyncio.create_task(probe.gone(self.nc, names.alive_subject(m.worker)))
            for m in self.members
            if not m.site and not self.site
        }
        try:
            return await self._ends_by(time.monotonic() + self.store.ttl_s + 2 * POLL_S, probes)
        finally:
            for t in probes.values():
                t.cancel()

    async def _ends_by(
        self, deadline: float, probes: dict[int, asyncio.Task[bool]]
    ) -> dict[int, MemberKey | None]:
        ends: dict[int, MemberKey | None] = {}
        seen: dict[int, tuple[int, float]] = {}
        while len(ends) < len(self.members) and time.monotonic() < deadline:
            for m in (m for m in self.members if m.rank not in ends):
                now, revision = await self.store.member_revision(
                    self.task.run_id, self.epoch, m.rank
                )
                since = seen.setdefault(m.rank, (revision, time.monotonic()))
                if revision != since[0]:
                    seen[m.rank] = (revision, time.monotonic())
                gone = m.rank in probes and probes[m.rank].done() and probes[m.rank].result()
                if now is None or now.state == "exited":
                    ends[m.rank] = now
                elif gone or time.monotonic() - seen[m.rank][1] >= SILENT_S:
                    ends[m.rank] = None
            if len(ends) < len(self.members):
                pending = [t for r, t in probes.items() if r not in ends and not t.done()]
                if pending:  # the next read as soon as a probe has its answer
                    await asyncio.wait(pending, timeout=POLL_S)
                else:
                    await asyncio.sleep(POLL_S)
        return ends

    def _rank_of(self, member: MemberKey) -> int:
        """A member's rank in the group: its place among the held slots (`_formed`)."""
        return self.members.index(member) + 1

    def _supersede(self) -> None:
        self.breakage = Breakage(0, self.worker, "a newer group replaced it", False)
        self.broken.set()

    async def renew(self) -> None:
        """Write the group's key again (its TTL starts over); `Superseded` if it changed
        since this leader's last write."""
        async with self._writing:
            revision = await self.store.write(self.group_key, self.key, self._revision)
            if revision is None:
                raise Superseded()
            self._revision = revision

    async def end(self) -> None:
        """The group is over (whatever the outcome): its members' processes stop. Only the
        key this leader wrote last is deleted, never a newer group's."""
        if self._revision:
            await self.store.delete(self.group_key, expected=self._revision)


_PEER_FAILED = "its process stopped because a peer failed"


def _cause(was: MemberKey, now: MemberKey | None, rank: int) -> Breakage | None:
    """What a member's key, read now, says about the group; None while all is well."""
    if now is None:
        return Breakage(rank, was.worker, SILENT, False)
    if now.state != "exited" or now.code == 0:
        return None
    if now.user_error:
        return Breakage(rank, now.worker, f"rank {rank}'s code failed", True, now.tail)
    if now.code == EXIT_GROUP_BROKEN:
        return Breakage(rank, now.worker, _PEER_FAILED, False, now.tail)
    code = now.code if now.code is not None else -1
    why = f"its process was killed by signal {-code}" if code < 0 else f"its process exited {code}"
    return Breakage(rank, now.worker, why, False, now.tail)


def local_rank(hosts: list[str], rank: int) -> int:
    """This rank's index among the group's ranks on its host."""
    return sum(1 for h in hosts[:rank] if h == hosts[rank])
