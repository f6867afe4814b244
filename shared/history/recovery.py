"""How long a run went without progress each time it was interrupted, and why — read from
its events (`shared.history.timeline`), on one clock (`shared.history.clocks`).

A recovery runs from an attempt's last step (or, had it none, its last sign of life) to the
next attempt's first step after its restore (or, before any step, to its restore): the
time the run made no progress — noticing the loss, handing the run over, starting, loading
the checkpoint. Its cause is how the earlier attempt ended:

    preemption     `preempted` (a SIGTERM, a drain; an elastic group growing)
    process kill   died, and its trainer's successor on the host handed the run over
    host loss      died, and its lease expired (its host or its link went silent)
    partition      fenced: it was cut off and kept training while another took the run
    rank loss      `rank_lost`: a rank of its group went away
    failure        `attempt_failed`: the user's code raised, or stalled
    divergence     `guarded`: the divergence guard stopped it
    lost run       died otherwise (the reaper found the run with nobody and dispatched it)

A run paused for a human is not recovering while it waits: the wait until it is resumed is
not counted (`paused` and `resumed` bound it).
"""

from __future__ import annotations

import itertools

import msgspec

from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.history.timeline import Attempt, attempts_of

CAUSES = (
    "preemption", "process kill", "host loss", "partition", "rank loss", "failure",
    "divergence", "lost run",
)  # fmt: skip


class Recovery(msgspec.Struct, frozen=True, kw_only=True):
    cause: str
    seconds: float
    from_step: int
    """The step the interrupted attempt had reached."""
    to_step: int
    """The step the next attempt resumed from."""


def recoveries(events: list[Event]) -> list[Recovery]:
    """Each interruption of the run whose events (in stream order, on one clock) are
    `events`, with the time it cost until the run stepped again."""
    out = []
    pending: tuple[str, float, int] | None = None
    """An interruption not over yet: its cause, its start, the step it had reached."""
    for a, b in itertools.pairwise(attempts_of(events)):
        if pending is None:
            if isinstance(a.end_event, ev.Paused):
                continue  # held for a human, not interrupted
            # Its last step; a partitioned attempt's steps during the cut may be heard of
            # only after its successor started, and from then on they were not the run's.
            last = min(a.times[-1] if a.times else a.alive_until, b.started.at)
            pending = (_cause(a, events), last, a.last_step)
        back = b.times[0] if b.times else (b.resumed.at if b.resumed else None)
        if back is None:
            continue  # the next attempt never got going: the interruption goes on
        cause, since, reached = pending
        waited = _paused_for(events, since, b.started.at)
        out.append(Recovery(cause=cause, seconds=max(0.0, back - since - waited),
                            from_step=reached, to_step=b.first_step))  # fmt: skip
        pending = None
    return out


def by_cause(found: list[Recovery]) -> dict[str, tuple[int, float]]:
    """Cause -> (how many, mean seconds), in `CAUSES` order."""
    out: dict[str, tuple[int, float]] = {}
    for cause in CAUSES:
        mine = [r.seconds for r in found if r.cause == cause]
        if mine:
            out[cause] = (len(mine), sum(mine) / len(mine))
    return out


def _cause(a: Attempt, events: list[Event]) -> str:
    end = a.end_event
    if isinstance(end, ev.Preempted):
        return "preemption"
    if isinstance(end, ev.Fenced):
        return "partition"
    if isinstance(end, ev.RankLost):
        return "rank loss"
    if isinstance(end, ev.Guarded):
        return "divergence"
    if isinstance(end, ev.AttemptFailed):
        return "failure"
    handed = next(
        (e for e in events if isinstance(e, ev.HandedOver) and e.token == a.started.token), None
    )
    if handed is not None:
        return "process kill" if "process died" in handed.reason else "host loss"
    return "lost run"


def _paused_for(events: list[Event], since: float, until: float) -> float:
    """Seconds between `since` and `until` that the run spent PAUSED."""
    total, paused_at = 0.0, None
    for e in events:
        if isinstance(e, ev.Paused) and since <= e.at <= until:
            paused_at = e.at
        elif isinstance(e, ev.Resumed) and paused_at is not None:
            total += min(e.at, until) - paused_at
            paused_at = None
    return total
