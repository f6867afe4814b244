"""Which runs make room for a queued run that finds no free trainer, and by which rule.

A run `v` holding trainers at the hub may make room for the head `h` of the queue — never
before it had `min_run_s` on its trainers, never while it is already leaving — by one of
three rules, each of which can only move the pool one way, so no cycle of runs preempting
each other can form:

    priority    v's priority is below h's, and h is within its owner's quota (or v's owner
                is over its own): the running priorities only ever rise
    quota       h is within its owner's quota, v's owner is over its own (v borrowed idle
                trainers): the trainers lent beyond quotas only ever shrink
    fair_share  h's owner holds less than its entitlement less `margin` and will not hold
                more than its entitlement plus `margin`; v's owner holds more than its
                entitlement and keeps at least its entitlement less `margin`; v's priority
                is not above h's: the owners' shortfalls below their shares only ever shrink

An elastic run gives up ranks above its minimum (a shrink: it re-forms smaller at its next
step boundary) before any run is preempted whole; then whole runs go, lowest priority
first, among equals the one with the least work since its last checkpoint. A group of
several ranks goes whole or not at all, and nothing is preempted unless enough is freed
for `h` to start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.scheduling.model import Phase, Preempt, Run


@dataclass(slots=True)
class Standing:
    """An owner's place in the pool during one pass."""

    holding: int
    """Trainers its runs hold or are allotted at the hub."""
    entitled: float
    """Its share of the hub's trainers (`shares.shares` times the trainers)."""
    quota: int | None


@dataclass(frozen=True, slots=True)
class Rules:
    margin: float
    min_run_s: float
    now: float


def borrowing(s: Standing, extra: int) -> bool:
    """Whether an owner holding `s.holding` trainers would be over its quota with `extra`."""
    return s.quota is not None and s.holding + extra > s.quota


def make_room(
    h: Run,
    missing: int,
    running: list[Run],
    standing: Callable[[str], Standing],
    rules: Rules,
) -> list[Preempt]:
    """The preemptions that free `missing` trainers for `h`, or none when they cannot."""
    mine = standing(h.owner)
    h_borrows = borrowing(mine, h.min_ranks)
    if not _may_take(h, h_borrows, mine, running, standing, rules):
        return []
    movable = [v for v in running if _movable(v, h, rules)]
    chosen: list[Preempt] = []
    freed = 0
    held = {o: standing(o).holding for o in {v.owner for v in movable}}
    # Surplus ranks of elastic runs first, then whole runs.
    for v in sorted(movable, key=lambda v: (v.priority, v.unsaved, -(v.running_since or 0))):
        if freed >= missing or not v.elastic or v.ranks <= v.min_ranks:
            continue
        kind = _rule(v, h, h_borrows, mine, standing(v.owner), held, rules, v.ranks - v.min_ranks)
        if kind is None:
            continue
        give = min(v.ranks - v.min_ranks, missing - freed)
        held[v.owner] -= give
        freed += give
        chosen.append(_order(v, h, kind, to_ranks=v.ranks - give))
    shrunk = {p.run_id for p in chosen}
    over = {o: n - standing(o).entitled for o, n in held.items()}
    order = sorted(
        (v for v in movable if v.run_id not in shrunk),
        key=lambda v: (v.priority, -over[v.owner], v.unsaved, -(v.running_since or 0),
                       v.run_id),
    )  # fmt: skip
    for v in order:
        if freed >= missing:
            break
        kind = _rule(v, h, h_borrows, mine, standing(v.owner), held, rules, v.ranks)
        if kind is None:
            continue
        held[v.owner] -= v.ranks
        freed += v.ranks
        chosen.append(_order(v, h, kind))
    return chosen if freed >= missing else []


def _may_take(
    h: Run,
    h_borrows: bool,
    mine: Standing,
    running: list[Run],
    standing: Callable[[str], Standing],
    rules: Rules,
) -> bool:
    """Whether any rule could let `h` take from anyone: a quick no for most of a full
    pool's queue, before the running runs are read one by one."""
    if any(v.priority < h.priority for v in running):
        return True
    if h_borrows:
        return False
    if mine.holding < mine.entitled - rules.margin:
        return True  # fair share may apply
    owners = {v.owner for v in running}
    return any(borrowing(standing(o), 0) for o in owners)  # quota may apply


def _movable(v: Run, h: Run, rules: Rules) -> bool:
    return (
        v.phase is Phase.RUNNING and not v.site and v.run_id != h.run_id and v.ranks > 0
        and v.running_since is not None and rules.now - v.running_since >= rules.min_run_s
    )  # fmt: skip


def _rule(
    v: Run,
    h: Run,
    h_borrows: bool,
    mine: Standing,
    theirs: Standing,
    held: dict[str, int],
    rules: Rules,
    freeing: int,
) -> str | None:
    """The rule by which `v` may give `freeing` trainers to `h`, or None."""
    v_borrows = theirs.quota is not None and held[v.owner] > theirs.quota
    if v.priority < h.priority and (not h_borrows or v_borrows):
        return "priority"
    if h_borrows:
        return None
    if v_borrows:
        return "quota"
    same = v.owner == h.owner
    short = mine.holding < mine.entitled - rules.margin
    within = mine.holding + h.min_ranks <= mine.entitled + rules.margin
    over = held[v.owner] > theirs.entitled
    keeps = held[v.owner] - freeing >= theirs.entitled - rules.margin
    if not same and short and within and over and keeps and v.priority <= h.priority:
        return "fair_share"
    return None


def _order(v: Run, h: Run, kind: str, to_ranks: int = 0) -> Preempt:
    why = {
        "priority": f"priority {h.priority} over {v.priority}",
        "quota": f"{v.owner or 'operator'} is over its quota; {h.owner or 'operator'} is within",
        "fair_share": f"{h.owner or 'operator'} is below its fair share, "
        f"{v.owner or 'operator'} above its own",
    }[kind]
    if to_ranks:
        why += f"; shrinks from {v.ranks} to {to_ranks} ranks"
    return Preempt(run_id=v.run_id, by=h.run_id, kind=kind, reason=why, to_ranks=to_ranks)
