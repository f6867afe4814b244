"""What the scheduler knows of its pools, and the queue it answers for.

`Reckoner` keeps the newest record of every run not over and the heartbeat of every
trainer heard lately (both fed by watches, `scheduler.py`), and each pool's decayed usage
per owner; from them it builds the `PoolState` a pass decides on (`shared.scheduling`).
`view_of` is the same state as people read it (`baton queue`, the dashboard).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict

from shared.config import Settings
from shared.contracts import RunRecord, RunState
from shared.contracts.control import WorkerInfo
from shared.contracts.pools import Pool, PoolTable
from shared.contracts.queue import OwnerShare, QueueView, Training, Waiting
from shared.scheduling import horizon
from shared.scheduling.horizon import MOST_AHEAD, Work
from shared.scheduling.model import Phase, PoolState, Run, SavedUsage, SiteRoom, queue_order
from shared.scheduling.plan import Pass, explain
from shared.scheduling.shares import Usage
from shared.state import transitions

RELEVANT = ("state", "admitted", "worker", "preempt", "site", "group", "ranks_cap", "token")
"""What a record's change must touch for a pass to follow it (a step advancing does not)."""


class Queued:
    """A pool's queued runs, each owner's kept in its order as records come and go, so a
    pass reads them as they stand instead of sorting the whole queue (`queue_order`)."""

    def __init__(self) -> None:
        self.by_owner: dict[str, list[Run]] = {}
        self._keys: dict[str, list[tuple[int, float, str]]] = {}
        self.priorities: Counter[int] = Counter()
        self.jobs: Counter[str] = Counter()
        """How many queued runs each job name has (whose speeds grants by time read)."""

    def add(self, run: Run) -> None:
        keys = self._keys.setdefault(run.owner, [])
        runs = self.by_owner.setdefault(run.owner, [])
        at = bisect.bisect_left(keys, queue_order(run))
        keys.insert(at, queue_order(run))
        runs.insert(at, run)
        self.priorities[run.priority] += 1
        if run.work is not None:
            self.jobs[run.work.job] += 1

    def remove(self, run: Run) -> None:
        keys, runs = self._keys[run.owner], self.by_owner[run.owner]
        at = bisect.bisect_left(keys, queue_order(run))
        assert runs[at].run_id == run.run_id, (run.run_id, runs[at].run_id)
        del keys[at], runs[at]
        self.priorities[run.priority] -= 1
        if run.work is not None:
            self.jobs[run.work.job] -= 1
            if self.jobs[run.work.job] <= 0:
                del self.jobs[run.work.job]
        if not runs:
            del self._keys[run.owner], self.by_owner[run.owner]


class Reckoner:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._records: dict[str, tuple[RunRecord, int]] = {}
        self._queued: dict[str, Queued] = defaultdict(Queued)
        """Per pool, the runs waiting for the scheduler."""
        self._waiting: dict[str, Run] = {}
        """Each of those runs' place in its pool's queue, by run id."""
        self._holding: dict[str, dict[str, Run]] = defaultdict(dict)
        """Per pool, the runs admitted, training or leaving, as a pass reads them (their
        time on their trainers and their unsaved steps brought up to date by `state`)."""
        self._workers: dict[str, tuple[WorkerInfo, float]] = {}
        self._since: dict[tuple[str, int | None], float] = {}
        """(run, token) → when it was first seen training under that token."""
        self._usage: dict[str, Usage] = {}
        self._accrued = time.monotonic()
        self.blocked: dict[str, dict[str, str]] = {}
        """Per pool, the queued runs its last pass left waiting, with why."""
        self.worker_ttl_s = max(2.0, 3 * settings.heartbeat_s) + 1.0
        """A trainer not heard for this long is gone (its heartbeat's own TTL, and a second)."""
        self.speeds: dict[str, dict[str, float]] = defaultdict(dict)
        """Per pool, the measured seconds per step of its job names (`speeds.py` reads
        them, for the pools granted by time)."""

    # -- following ---------------------------------------------------------------------------

    def observe(self, record: RunRecord, revision: int) -> bool:
        """Keep `record` (a watch's `revision`, or 0 from a writer that just wrote it);
        whether a pass should follow."""
        run_id = record.run_id
        old = self._records.get(run_id)
        if old is not None and revision and old[1] >= revision:
            return False
        self._unplace(run_id, old[0] if old else None)
        if record.state.terminal or record.state is RunState.PAUSED:
            gone = self._records.pop(run_id, None)
            return gone is not None
        self._records[run_id] = (record, revision)
        self._place(record)
        if old is None:
            return True
        return any(getattr(old[0], f) != getattr(record, f) for f in RELEVANT)

    def forget_revisions(self) -> None:
        """The runs bucket went back (a hub that lost its newest writes): the records kept
        stand, but whatever the bucket now says of them, at any revision, replaces them."""
        self._records = {run_id: (r, 0) for run_id, (r, _) in self._records.items()}

    def _place(self, r: RunRecord) -> None:
        if r.cancel_requested or r.pause_requested:
            return  # the dispatcher ends it, or its trainer stops it: no place in a pass
        if r.state is RunState.QUEUED and not r.admitted and not r.site:
            run = _queued(r)
            self._waiting[r.run_id] = run
            self._queued[r.spec.pool].add(run)
        else:
            self._holding[r.spec.pool][r.run_id] = _holder(r)

    def _unplace(self, run_id: str, old: RunRecord | None) -> None:
        if old is None:
            return
        waiting = self._waiting.pop(run_id, None)
        if waiting is not None:
            self._queued[old.spec.pool].remove(waiting)
        self._holding[old.spec.pool].pop(run_id, None)

    def heard(self, info: WorkerInfo) -> bool:
        """Keep a trainer's heartbeat; whether a pass should follow (a trainer new, or
        drained, undrained or freed since its last one)."""
        old = self._workers.get(info.worker)
        self._workers[info.worker] = (info, time.monotonic())
        if old is None:
            return True
        was = old[0]
        return (was.drained, was.run_id, was.pool) != (info.drained, info.run_id, info.pool)

    def record(self, run_id: str) -> RunRecord | None:
        found = self._records.get(run_id)
        return found[0] if found is not None else None

    def workers(self) -> list[WorkerInfo]:
        """Trainers heard within their heartbeat's TTL."""
        now = time.monotonic()
        for name, (_, at) in list(self._workers.items()):
            if now - at > self.worker_ttl_s:
                del self._workers[name]
        return [info for info, _ in self._workers.values()]

    def pools(self) -> list[str]:
        names = {r.spec.pool for r, _ in self._records.values()}
        return sorted(names | {w.pool for w in self.workers()})

    def records_of(self, pool: str) -> list[RunRecord]:
        return [r for r, _ in self._records.values() if r.spec.pool == pool]

    def site_pools(self) -> bool:
        """Whether any trainer at a site is live (only then are sites' links looked at)."""
        return any(w.site for w in self.workers())

    def unsent_grants(self, linked: set[str]) -> list[RunRecord]:
        """Runs granted to a linked site and not started there: their grant may need
        sending again (`Delegation.resend` knows which the site took)."""
        return [
            r for r, _ in self._records.values()
            if r.site in linked and r.state is RunState.QUEUED
        ]  # fmt: skip

    # -- usage ---------------------------------------------------------------------------------

    def usage(self, pool: str, policy: Pool) -> Usage:
        found = self._usage.get(pool)
        if found is None:
            found = self._usage[pool] = Usage(policy.fair_share.half_life_s)
        found.retune(policy.fair_share.half_life_s)
        return found

    def accrue(self, table: PoolTable) -> None:
        """Every training run's trainer-seconds since the last call, to its owner's usage."""
        now = time.monotonic()
        dt, self._accrued = now - self._accrued, now
        for pool, holding in self._holding.items():
            used = self.usage(pool, table.pool(pool))
            for run in holding.values():
                r = self._records[run.run_id][0]
                if r.state is RunState.RUNNING and r.worker:
                    used.add(r.owner, _held(r) * dt, now)

    def usage_snapshots(self) -> dict[str, SavedUsage]:
        now = time.monotonic()
        return {
            pool: SavedUsage(owners=u.snapshot(now), at=time.time())
            for pool, u in self._usage.items()
        }

    def restore_usage(self, saved: dict[str, SavedUsage], table: PoolTable) -> None:
        now, wall = time.monotonic(), time.time()
        for pool, kept in saved.items():
            self.usage(pool, table.pool(pool)).restore(kept.owners, max(0.0, wall - kept.at), now)

    # -- a pool's state ----------------------------------------------------------------------

    def state(self, pool: str, policy: Pool, linked: set[str]) -> PoolState:
        """What a pass over `pool` decides on: its queued runs as kept (not copied), the
        runs holding its trainers built anew (their time on them, their unsaved steps)."""
        now = time.monotonic()
        workers = [w for w in self.workers() if w.pool == pool and not w.drained]
        steps = {w.run_id: w.step for w in workers if w.run_id and w.step is not None}
        # A run held by a site none of whose trainers is counted (cut off, its heartbeats
        # gone) holds none of the trainers counted here: the hub's own stay free for work.
        sites = {w.site for w in workers}
        runs = [r for r in self._holding[pool].values() if not r.site or r.site in sites]
        for run in runs:
            r = self._records[run.run_id][0]
            if run.phase is Phase.RUNNING and r.worker:
                run.running_since = self._since.setdefault((r.run_id, r.token), now)
            run.unsaved = max(0, steps.get(r.run_id, r.step) - r.step)
        for key in [k for k in self._since if k[0] not in self._records]:
            del self._since[key]
        queued = self._queued[pool]
        at_hub = sum(1 for w in workers if not w.site)
        hub_free = at_hub - sum(r.holds for r in runs if not r.site)
        return PoolState(
            name=pool, policy=policy, trainers=len(workers), runs=runs,
            queued=queued.by_owner, priorities=queued.priorities,
            usage=self.usage(pool, policy).values(now),
            sites=self._rooms(pool, policy, workers, linked, steps),
            hub_free=max(0, hub_free), speeds=self.speeds[pool], now=now,
        )  # fmt: skip

    def queued_jobs(self, pool: str) -> list[str]:
        """The job names of `pool`'s queued runs."""
        return list(self._queued[pool].jobs)

    def by_time(self, pool: str, policy: Pool, linked: set[str]) -> bool:
        """Whether some linked site with a live trainer of `pool` is granted it by time."""
        sites = {w.site for w in self.workers() if w.pool == pool and w.site in linked}
        return any(self.settings.horizon(s, policy.grant_ahead_s) for s in sites)

    def _rooms(
        self, pool: str, policy: Pool, workers: list[WorkerInfo], linked: set[str],
        steps: dict[str, int],
    ) -> dict[str, SiteRoom]:  # fmt: skip
        """Per linked site with grants on: ranks it may still be granted (per live trainer
        of the pool there, the one it trains and `BATON_DELEGATE_AHEAD` more — or, granted
        by time, `horizon.MOST_AHEAD` more — less the ranks of the runs it holds), and by
        time the expected seconds it may still be granted (`horizon.room`)."""
        trainers: dict[str, int] = defaultdict(int)
        for w in workers:
            by_time = self.settings.horizon(w.site, policy.grant_ahead_s)
            if w.site in linked and (by_time or self.settings.ahead(w.site) > 0):
                trainers[w.site] += 1
        if not trainers:
            return {}
        held: dict[str, int] = defaultdict(int)
        work: dict[str, list[float | None]] = defaultdict(list)
        for r, _ in self._records.values():
            if r.site and r.spec.pool == pool:
                held[r.site] += r.spec.max_ranks
                done = max(r.step, steps.get(r.run_id, 0))
                work[r.site].append(horizon.expected_s(_work(r, done), self.speeds[pool]))
        out = {}
        for site, n in trainers.items():
            secs = self.settings.horizon(site, policy.grant_ahead_s)
            if secs:
                out[site] = SiteRoom(
                    free=n * (1 + MOST_AHEAD) - held[site], spare=n * MOST_AHEAD,
                    time=horizon.room(n, secs, work[site]),
                )  # fmt: skip
                continue
            ahead = self.settings.ahead(site)
            out[site] = SiteRoom(free=n * (1 + ahead) - held[site], spare=n * ahead)
        return out


def _held(r: RunRecord) -> int:
    """Trainers a training (or handing over) run holds: its group, capped by a shrink."""
    size = max(1, r.group_size or len(r.group) or 1)
    return min(size, r.ranks_cap) if r.ranks_cap else size


def _work(r: RunRecord, done: int) -> Work:
    """What `r`'s expected seconds are reckoned from, `done` of its steps trained."""
    return Work(
        job=r.spec.name, steps=r.spec.total_steps - done, total_steps=r.spec.total_steps,
        estimate_s=r.spec.estimate_s, ranks=r.spec.max_ranks,
    )  # fmt: skip


def _queued(r: RunRecord) -> Run:
    """A run waiting for the scheduler: everything a pass reads of it is in its record."""
    return Run(
        run_id=r.run_id, owner=r.owner, priority=r.priority, order=r.created_at,
        phase=Phase.QUEUED, min_ranks=r.spec.min_ranks, max_ranks=r.spec.max_ranks,
        cap=r.ranks_cap, grantable=transitions.grantable(r), replica=r.spec.replica is not None,
        work=_work(r, r.step),
    )  # fmt: skip


def _holder(r: RunRecord) -> Run:
    """A run admitted, training or leaving, as a pass reads it (`Reckoner.state` keeps its
    time on its trainers and its unsaved steps up to date)."""
    if r.state is RunState.QUEUED:
        phase = Phase.ADMITTED
    elif r.preempt is not None and not r.preempt.to_ranks:
        phase = Phase.LEAVING
    else:
        phase = Phase.RUNNING
    ranks = 0
    if phase is Phase.RUNNING:
        ranks = _held(r)
    elif phase is Phase.ADMITTED:
        ranks = 1 if r.site else (r.ranks_cap or r.spec.min_ranks)
    return Run(
        run_id=r.run_id, owner=r.owner, priority=r.priority, order=r.created_at, phase=phase,
        min_ranks=r.spec.min_ranks, max_ranks=r.spec.max_ranks, ranks=ranks,
        cap=r.ranks_cap, site=r.site, replica=r.spec.replica is not None,
    )  # fmt: skip


def view_of(reckoner: Reckoner, pool: str, policy: Pool, limit: int) -> QueueView:
    """`pool`'s queue in the order the next pass takes it, each run with why it waits."""
    state = reckoner.state(pool, policy, set())
    p = Pass(state)
    leaving = {r.run_id: r for r in reckoner.records_of(pool) if r.preempt is not None}
    for_whom = {v.preempt.by: v for v in leaving.values() if v.preempt is not None}
    blocked = reckoner.blocked.get(pool, {})

    def reason(run: Run) -> str | None:
        victim = for_whom.get(run.run_id)
        if victim is not None and victim.preempt is not None:
            return f"preempting {victim.run_id} ({victim.preempt.reason})"
        return blocked.get(run.run_id) if run.phase is Phase.QUEUED else None

    wall = time.time()
    ordered, total = explain(state, reason, limit)
    waiting = []
    for i, (run, why) in enumerate(ordered):
        r = reckoner.record(run.run_id)
        waiting.append(Waiting(
            run_id=run.run_id, owner=run.owner, priority=run.priority, position=i,
            state=run.phase.value, ranks=run.ranks or run.min_ranks, waiting=why,
            queued_s=max(0.0, wall - r.created_at) if r else 0.0,
            preemptions=r.preemptions if r else 0,
        ))  # fmt: skip
    training = []
    for run in state.runs:
        if run.phase in (Phase.RUNNING, Phase.LEAVING):
            r = reckoner.record(run.run_id)
            victim = leaving.get(run.run_id)
            why = victim.preempt.reason if victim and victim.preempt else ""
            training.append(Training(
                run_id=run.run_id, owner=run.owner, priority=run.priority, ranks=run.ranks or 1,
                worker=r.worker or "" if r else "", site=run.site,
                leaving=f"for {victim.preempt.by}: {why}" if victim and victim.preempt else "",
                preemptions=r.preemptions if r else 0,
            ))  # fmt: skip
    return QueueView(
        pool=pool, trainers=state.trainers, free=max(0, p.free), waiting=waiting,
        training=sorted(training, key=lambda t: (-t.priority, t.run_id)),
        owners=_owners(reckoner, p, policy, pool), more=max(0, total - len(ordered)),
    )  # fmt: skip


def _owners(reckoner: Reckoner, p: Pass, policy: Pool, pool: str) -> list[OwnerShare]:
    preempted: dict[str, int] = defaultdict(int)
    for r in reckoner.records_of(pool):
        preempted[r.owner] += r.preemptions
    out = []
    for owner, share in sorted(p.share.items()):
        s = p.standing(owner)
        terms = policy.owner(owner)
        out.append(OwnerShare(
            owner=owner, weight=terms.weight, team=policy.team_of(owner), share=share,
            entitled=s.entitled, holding=s.holding, usage_s=p.state.usage.get(owner, 0.0),
            quota=terms.quota, max_priority=policy.highest_priority(owner),
            preempted=preempted[owner],
        ))  # fmt: skip
    return out
