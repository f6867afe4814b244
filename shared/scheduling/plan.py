"""One scheduling pass over a pool: which queued runs start, where, and who makes room.

The queue's order, for each queued run of owner `o` (lowest first):

    1. borrowing      o would be over its quota with this run
    2. -priority      higher priority first
    3. not short      o holds no less than its entitlement less the margin (an owner
                      short of its share goes first: the same test its reclaiming uses)
    4. beyond share   o would hold more than its entitlement plus the margin
    5. standing       o's decayed usage over its share (`shares`)
    6. age            earlier submissions first

re-evaluated after every run the pass places (an owner's holding changes as its runs
start). Each run, in that order, goes to a free trainer at the hub, else to a site with
room for it (a grant), else it takes trainers from runs it may preempt (`victims`); else
it waits, and the pass goes on with runs that may fit where it did not (a run of one rank
behind a group waiting for two), but stops preempting for anyone once a run found nothing
to take. Trainers nothing queued can use go to elastic runs below their `max` (`Cap`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from shared.scheduling.horizon import Horizon, expected_s
from shared.scheduling.model import (
    Admit,
    Cap,
    Grant,
    Phase,
    Plan,
    PoolState,
    Run,
    SiteRoom,
)
from shared.scheduling.shares import shares
from shared.scheduling.victims import Rules, Standing, borrowing, make_room

Key = tuple[bool, int, bool, bool, float, float, str]


class Pass:
    """The state of one pass: who holds what, as placements change it. The state's runs are
    never changed: a run placed or made room by is a copy kept here."""

    def __init__(self, state: PoolState) -> None:
        self.state = state
        self.policy = state.policy
        self.free = state.trainers - sum(r.holds for r in state.runs)
        self.holding: dict[str, int] = defaultdict(int)
        for r in state.runs:
            self.holding[r.owner] += r.holds
        active = {o for o, rs in state.queued.items() if rs}
        active |= {o for o, n in self.holding.items() if n > 0}
        self.share = shares(self.policy, active) if active else {}
        self.running = [r for r in state.runs if r.phase is Phase.RUNNING and not r.site]
        self.placed: list[Run] = []
        """Runs admitted or granted in this pass (copies)."""
        self.sites = {s: _copy(room) for s, room in state.sites.items()}
        self.hub_free = state.hub_free
        above = sorted(state.priorities.items(), reverse=True)
        self._above = [(prio, n) for prio, n in above if n > 0]

    def higher(self, priority: int) -> tuple[int, int, bool] | None:
        """Runs queued when the pass began with a priority above `priority`: how many, the
        highest, and whether they all have it; None when there are none."""
        over = [(prio, n) for prio, n in self._above if prio > priority]
        if not over:
            return None
        return sum(n for _, n in over), over[0][0], len(over) == 1

    def standing(self, owner: str) -> Standing:
        entitled = self.share.get(owner, 0.0) * self.state.trainers
        return Standing(self.holding[owner], entitled, self.policy.owner(owner).quota)

    def key(self, r: Run) -> Key:
        s = self.standing(r.owner)
        margin = self.policy.fair_share.margin
        short = s.holding < s.entitled - margin
        beyond = s.holding + r.min_ranks > s.entitled + margin
        used = self.state.usage.get(r.owner, 0.0) / max(self.share.get(r.owner, 0.0), 1e-9)
        return (borrowing(s, r.min_ranks), -r.priority, not short, beyond, used, r.order, r.run_id)

    def admit(self, r: Run, ranks: int, cap: int | None) -> Admit:
        self.free -= ranks
        self.hub_free -= ranks
        self.holding[r.owner] += ranks
        self.placed.append(replace(r, phase=Phase.ADMITTED, ranks=ranks, cap=cap))
        return Admit(r.run_id, ranks, cap)

    def site_for(self, r: Run) -> str | None:
        """A site with room for `r`, its room taken (and the trainers free there now, for
        the part not ahead of need: they were counted free for the hub's work too). A
        replica, or a group of several ranks, which must train at once, goes only where
        enough trainers are free now. Granted by time, a site is granted ahead of need
        only while its expected seconds are below its horizon (`horizon`), and only a run
        no trainer free now could start (a long horizon never leaves the hub's idle)."""
        if not r.grantable:
            return None
        need = r.min_ranks
        at_once = r.replica or need > 1
        expected: float | None = None
        for site in sorted(self.sites):
            room = self.sites[site]
            now = room.free - room.spare
            if now < need if at_once else room.free < need:
                continue
            if room.time is not None:
                ahead = not at_once and now < need
                if ahead and (not room.time.fits() or self.hub_free >= need):
                    continue  # past its horizon, or a hub trainer free now takes it
                if expected is None and r.work is not None:
                    expected = expected_s(r.work, self.state.speeds)
                room.time.take(expected)
            self.free -= min(need, max(now, 0))
            room.free -= need
            return site
        return None


def _copy(room: SiteRoom) -> SiteRoom:
    time = room.time
    held = Horizon(time.horizon_s, time.seconds) if time is not None else None
    return SiteRoom(room.free, room.spare, held)


PREEMPTION_TRIES = 8
"""Queued runs one pass tries to make room for, at most: past a few that found nothing to
take, later ones (lower in the order) would rarely fare better, and each try reads every
running run."""
REASONS = 50
"""Queued runs a pass says why they wait (`Plan.blocked`), at most: the front of the queue.
`explain` says it of every run, when asked."""


class _Queues:
    """Each owner's queue as a pass goes through it: the next run of each, in the pass's
    order (a heap of owners by their next run's key, re-keyed as the pass places runs)."""

    def __init__(self, p: Pass) -> None:
        self.p = p
        self.at = {o: 0 for o, rs in p.state.queued.items() if rs}
        self.heap = [(p.key(p.state.queued[o][0]), o) for o in self.at]
        heapq.heapify(self.heap)

    def pop(self) -> Run | None:
        """The next run in the pass's order, or None when every queue is through."""
        if not self.heap:
            return None
        _, owner = heapq.heappop(self.heap)
        runs = self.p.state.queued[owner]
        r = runs[self.at[owner]]
        self.at[owner] += 1
        if self.at[owner] < len(runs):
            heapq.heappush(self.heap, (self.p.key(runs[self.at[owner]]), owner))
        return r


def plan(state: PoolState, reasons: int = REASONS) -> Plan:
    """The decisions of one pass over `state` (see the module's docstring); at most
    `reasons` of the runs left waiting say why."""
    p = Pass(state)
    out = Plan()
    rules = Rules(state.policy.fair_share.margin, state.policy.min_run_s, state.now)
    tries = PREEMPTION_TRIES if state.policy.preemption else 0
    queues = _Queues(p)
    waiting = False
    while (r := queues.pop()) is not None:
        placed = _place(p, r, out)
        if not placed and tries > 0 and p.free < r.min_ranks:
            tries -= 1
            placed = _take(p, r, out, rules)
        if not placed:
            waiting = True
            if len(out.blocked) < reasons:
                _block(p, r, out)
        if p.free <= 0 and tries <= 0 and not any(s.open() for s in p.sites.values()):
            # Nothing more can start: only say why, for the front of the queue.
            while len(out.blocked) < reasons and (rest := queues.pop()) is not None:
                _block(p, rest, out)
            break
    if not waiting:
        _grow(p, out)
    return out


def _place(p: Pass, r: Run, out: Plan) -> bool:
    """A site with room first (a run granted there trains through a cut), else a free
    trainer for the hub's queue."""
    site = p.site_for(r)
    if site is not None:
        p.placed.append(replace(r, phase=Phase.ADMITTED, site=site, ranks=r.min_ranks))
        out.actions.append(Grant(r.run_id, site))
        return True
    if p.free >= r.min_ranks and p.state.trainers > 0:
        out.actions.append(p.admit(r, r.min_ranks, r.min_ranks if r.elastic else None))
        return True
    return False


def _take(p: Pass, r: Run, out: Plan, rules: Rules) -> bool:
    """Preempt for `r` what it may take, and admit it into the room made."""
    missing = r.min_ranks - max(0, p.free)
    if r.min_ranks > p.state.trainers:
        return False
    chosen = make_room(r, missing, p.running, p.standing, rules)
    if not chosen:
        return False
    for order in chosen:
        i, v = next((i, v) for i, v in enumerate(p.running) if v.run_id == order.run_id)
        given = v.ranks - order.to_ranks
        p.holding[v.owner] -= given
        p.free += given
        if order.to_ranks:
            p.running[i] = replace(v, ranks=order.to_ranks, cap=order.to_ranks)
        else:
            del p.running[i]
        out.actions.append(order)
    out.actions.append(p.admit(r, r.min_ranks, r.min_ranks if r.elastic else None))
    return True


def _block(p: Pass, r: Run, out: Plan) -> None:
    out.blocked[r.run_id] = why_waiting(p, r)
    out.waiting[r.run_id] = why_waiting(p, r, counts=False)


def _grow(p: Pass, out: Plan) -> None:
    """Trainers nothing queued can use go to the elastic runs at the hub below their `max`,
    highest priority first: their caps rise (a group forming takes them at once, one
    training grows at its next chance). A run admitted in this pass is admitted with it."""
    if p.free <= 0:
        return
    admitted = [r for r in p.state.runs if r.phase is Phase.ADMITTED and not r.site]
    grown: dict[str, int] = {}
    for r in sorted([*p.running, *admitted, *p.placed], key=lambda r: (-r.priority, r.order)):
        if r.site or not r.elastic:
            continue
        cap = r.cap if r.cap is not None else r.max_ranks
        if cap < r.max_ranks and p.free > 0:
            more = min(r.max_ranks - cap, p.free)
            p.free -= more
            grown[r.run_id] = cap + more
    for i, action in enumerate(out.actions):
        if isinstance(action, Admit) and action.run_id in grown:
            out.actions[i] = Admit(action.run_id, action.ranks, grown.pop(action.run_id))
    out.actions += [Cap(run_id, cap) for run_id, cap in grown.items()]


def why_waiting(p: Pass, r: Run, counts: bool = True) -> str:
    """Why queued run `r` does not start now, in a person's words; without `counts`, in
    words that stay the same while only the numbers around it move (what its record says)."""
    pool = p.state.name
    s = p.standing(r.owner)
    who = r.owner or "operator"
    if p.state.trainers == 0 and not p.sites:
        return f"no trainer of pool {pool!r} is live"
    if r.min_ranks > p.state.trainers and not p.sites:
        return f"needs {r.min_ranks} trainers at once; pool {pool!r} has {p.state.trainers} live"
    if borrowing(s, r.min_ranks):
        held = f" {s.holding}/{s.quota}" if counts else f" of {s.quota}"
        return f"{who} at quota{held}: waits for a trainer nobody within quota wants"
    above = p.higher(r.priority)
    if above:
        n, top, one = above
        if not counts:
            return "behind runs of higher priority"
        return (
            f"behind {n} run(s) of priority {top}"
            if one
            else (f"behind {n} run(s) of higher priority (up to {top})")
        )
    others = len(p.share) > 1  # alone in the pool, its share is all of it
    margin = p.policy.fair_share.margin
    if others and s.holding + r.min_ranks > s.entitled + margin and s.entitled > 0:
        now = f" ({s.holding} of {s.entitled:.1f} trainers)" if counts else ""
        return f"{who} at its fair share{now}"
    if r.min_ranks > 1:
        return f"waiting for {r.min_ranks} trainers of pool {pool!r} at once"
    return f"waiting for a trainer of pool {pool!r}"


def explain(
    state: PoolState, reasons: Callable[[Run], str | None], limit: int = 200
) -> tuple[list[tuple[Run, str]], int]:
    """The first `limit` runs of the pool that are admitted or queued and not yet training,
    in the order the next pass would take them, each with why it waits (`reasons` may say
    first: a run being made room for); and how many there are in all. Each owner's queue
    is in its order already, so they are merged, not sorted: the cost follows `limit`."""
    p = Pass(state)
    admitted = sorted((r for r in state.runs if r.phase is Phase.ADMITTED), key=lambda r: r.order)
    merged = heapq.merge(*state.queued.values(), key=p.key)
    out = [(r, reasons(r) or _admitted(r)) for r in admitted[:limit]]
    for r in itertools.islice(merged, max(0, limit - len(out))):
        out.append((r, reasons(r) or why_waiting(p, r)))
    return out, len(admitted) + sum(state.priorities.values())


def _admitted(r: Run) -> str:
    if r.site:
        return f"granted to site {r.site}: starts there when a trainer takes it"
    return (
        "admitted: a trainer takes it next"
        if r.min_ranks == 1
        else (f"admitted: forming its group of {r.ranks}")
    )
