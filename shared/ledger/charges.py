"""What a run is charged: read from its events, the way its goodput is.

Invariant: a run is charged for its productive trainer-seconds — steps whose progress was
kept (`shared.history.goodput`) — and for the whole of every attempt its own code failed
(an `attempt_failed` of its code, not of a machine's or its hardware's; a divergence
guard's stop or rollback; the run's `failed` after its code failed), each second times
the ranks of the attempt, at its price for the attempt's device kind (`Started.device`).
Nothing else: steps redone after a kill, a cut or a lost rank, the time to notice and hand
over, restores, waiting in the queue, the checkpoint a preemption takes, a replicated run's
round waits (in every attempt), an attempt a lost machine or a hardware fault ended, a
guard's pause — Baton's failures, the machines', and its way of working are never the
owner's to pay for.

The events are those of `shared.bus.history.run_events`, on the hub's clock, so every
reader of a run — the reaper settling it, a test checking the ledger — computes the same
seconds from the same events, and the same charge.
"""

from __future__ import annotations

import msgspec

from shared.contracts import RunRecord
from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.contracts.pools import units
from shared.history.goodput import END, per_attempt
from shared.history.timeline import Attempt

BATONS_OWN = ("gave up after ", "hard_timeout")
"""How `failed` reasons that are not the run's own code's failure begin: its task used up
its deliveries (trainers kept dying under it), or the hub stopped it at its time limit."""


class Charge(msgspec.Struct, frozen=True, kw_only=True):
    productive_s: float
    """Trainer-seconds of kept progress."""
    failed_s: float
    """Trainer-seconds of attempts its own code failed, beyond their kept progress."""
    free_s: float
    """Every other trainer-second of its attempts: not charged."""
    charged: int
    """In units (`shared.contracts.pools.units`)."""


def own_failure(a: Attempt) -> bool:
    """Whether attempt `a` ended because the run's own code failed: an `attempt_failed`
    that names no fault of a machine's or its hardware's, the divergence guard's stop or
    rollback (its model diverged; a pause holds it for a human, and is no failure), or the
    run's `failed` after its code failed."""
    end = a.end_event
    if isinstance(end, ev.AttemptFailed):
        return not end.fault
    if isinstance(end, ev.Guarded):
        return end.action != "pause"
    return isinstance(end, ev.Failed) and not end.reason.startswith(BATONS_OWN)


def life_events(events: list[Event], life: int) -> list[Event]:
    """The events of life `life` of a run whose events are `events` (in stream order). A
    life after the first (a settled run reopened by a rollback) begins at its `reopened`
    event, and each life runs to the next one's: so each is charged its own trainer-seconds
    only, and events that reach the stream after a life's end — a site's, sourced once its
    link heals — are still that life's. A history without the marker (a reopening older
    Baton wrote) is split at each life's terminal event instead."""
    marks = _marks(events)
    if life == 0 or life in marks:
        first = marks[life] + 1 if life else 0
        later = [i for n, i in marks.items() if n > life]
        return events[first : min(later, default=len(events))]
    ends = [i for i, e in enumerate(events) if isinstance(e, END)]
    if life > len(ends) or (marks and max(marks) < life):
        return []  # not begun (yet)
    first = ends[life - 1] + 1
    last = ends[life] + 1 if life < len(ends) else len(events)
    return events[first:last]


def whole(events: list[Event], life: int) -> bool:
    """Whether `events` (a run's, in stream order) begin at or before life `life`'s
    beginning: the run's `accepted` for its first life, its `reopened` for a later one (in
    a history without the marker: its `accepted` and the lives' ends before). False when
    the stream's retention dropped it."""
    accepted = any(isinstance(e, ev.Accepted) for e in events)
    marks = _marks(events)
    if life == 0 or life in marks:
        return accepted or life > 0
    if marks and max(marks) < life:
        return False  # not begun (yet)
    return accepted and sum(isinstance(e, END) for e in events) >= life


def _marks(events: list[Event]) -> dict[int, int]:
    """Each life's first `reopened` event's index."""
    marks: dict[int, int] = {}
    for i, e in enumerate(events):
        if isinstance(e, ev.Reopened):
            marks.setdefault(e.life, i)
    return marks


def round_waits(events: list[Event]) -> dict[tuple[str, int], float]:
    """A replicated run's round waits (`round` events' `waited_s`) by attempt — (worker,
    token) — each that of the worker's newest `started` before it: a worker's every
    attempt has its own waits taken off, not only its first."""
    current: dict[str, int] = {}
    waits: dict[tuple[str, int], float] = {}
    for e in events:
        if isinstance(e, ev.Started):
            current[e.worker] = e.token
        elif isinstance(e, ev.Round) and e.worker in current:
            at = (e.worker, current[e.worker])
            waits[at] = waits.get(at, 0.0) + e.note.waited_s
    return waits


def charge(events: list[Event], price: dict[str, float]) -> Charge:
    """The charge of the run whose events (in stream order, on one clock) are `events`, at
    `price` (credits per trainer-second by device kind; `*` for any other)."""
    waits = round_waits(events)
    productive = failed = free = credits = 0.0
    for share in per_attempt(events):
        a, parts = share.attempt, share.parts
        ranks = max(1, a.started.ranks)
        waited = min(waits.get((a.started.worker, a.started.token), 0.0), parts["productive"])
        kept = parts["productive"] - waited
        mine = sum(parts.values()) - parts["recovery"]
        extra = mine - kept if own_failure(a) else 0.0
        rate = price.get(a.started.device, price.get("*", 0.0))
        productive += kept * ranks
        failed += extra * ranks
        free += (mine - kept - extra) * ranks
        credits += (kept + extra) * ranks * rate
    return Charge(productive_s=productive, failed_s=failed, free_s=free, charged=units(credits))


def metered(r: RunRecord) -> Charge:
    """The charge of run `r`'s life as its trainers metered it (`RunRecord.life_metered_s`,
    at its dearest price), never more than the life held: for a run whose events are gone."""
    rate = max(r.price.values(), default=0.0)
    seconds = r.life_metered_s
    return Charge(
        productive_s=seconds, failed_s=0.0, free_s=0.0, charged=min(r.held, units(seconds * rate))
    )
