"""A run's attempts, read from its events in stream order — never by comparing the clocks of
different hosts to order them.

An attempt begins with its `started` event and ends with its own `preempted`, `fenced`,
`rank_lost`, `guarded` or `attempt_failed` event, the run's end or its pause; else with the
next `started` (its trainer died without a word: outcome `died`). A fenced attempt may end
after its successor started. Each other event belongs to the attempt of its worker (a
commit: of its token), else to the newest attempt.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from shared.contracts import events as ev
from shared.contracts.events import Event, kind_of


@dataclass
class Attempt:
    index: int
    row: int
    """Its lane on a timeline: one per worker, in order of first appearance."""
    started: ev.Started
    outcome: str = "running"
    end_at: float = 0.0
    alive_until: float = 0.0
    """Its last sign of life; before `end_at` when its death had to be noticed."""
    end_event: Event | None = None
    resumed: ev.Restored | None = None
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """When each of `steps` was reported."""
    losses: list[float] = field(default_factory=list)
    commits: list[ev.CheckpointCommitted] = field(default_factory=list)
    stall_s: float = 0.0
    """Seconds its training loop was blocked by checkpoints, as last reported."""
    redone: tuple[int, int] | None = None
    """Steps (from, to] computed here that the next attempt computed again: it resumed from
    an older commit than this attempt reached."""

    @property
    def first_step(self) -> int:
        return self.resumed.step if self.resumed else self.started.start_step

    @property
    def last_step(self) -> int:
        return max([self.first_step, *self.steps, *(c.step for c in self.commits)])


def attempts_of(events: list[Event]) -> list[Attempt]:
    """The attempts of a run whose events, in stream order, are `events`."""
    starts = [i for i, e in enumerate(events) if isinstance(e, ev.Started)]
    out = _split(events, starts)
    _attribute(events, starts, out)
    for a in out:  # one still running lasts until the newest event
        a.end_at = max(a.end_at, a.started.at, events[-1].at if a.outcome == "running" else 0)
    for a, b in itertools.pairwise(out):
        if b.first_step < a.last_step:
            a.redone = (b.first_step, a.last_step)
    return out


def _split(events: list[Event], starts: list[int]) -> list[Attempt]:
    """An attempt for each `started` event (at the indices `starts`), with how and when it
    ended."""
    out: list[Attempt] = []
    rows: dict[str, int] = {}
    for n, i in enumerate(starts):
        s = events[i]
        assert isinstance(s, ev.Started)
        row = rows.setdefault(s.worker, len(rows))
        a = Attempt(n, row, s, end_at=s.at, alive_until=s.at)
        nxt = next((j for j in starts if j > i), None)
        own = next((j for j in range(i + 1, len(events)) if _ends(s, events[j])), None)
        if own is not None and (nxt is None or own < nxt or isinstance(events[own], ev.Fenced)):
            a.end_event, a.end_at = events[own], events[own].at
            a.outcome = kind_of(events[own]).removeprefix("attempt_")
        elif nxt is not None:
            a.outcome, a.end_at = "died", events[nxt].at
        out.append(a)
    return out


def _attribute(events: list[Event], starts: list[int], attempts: list[Attempt]) -> None:
    """Give each attempt its resume, progress, commits and last sign of life."""
    by_token = {a.started.token: a for a in attempts}
    current: dict[str, Attempt] = {}
    latest: Attempt | None = None
    for i, e in enumerate(events):
        if isinstance(e, ev.Started):
            latest = current[e.worker] = attempts[starts.index(i)]
            continue
        who = current.get(getattr(e, "worker", ""), latest)
        if isinstance(e, ev.CheckpointCommitted | ev.CommitRefused):
            who = by_token.get(e.token, who)
        if who is None:
            continue
        if isinstance(e, ev.Restored) and who.resumed is None:
            who.resumed = e
        elif isinstance(e, ev.Progress):  # nan leaves a gap in the curve
            who.steps.append(e.step)
            who.times.append(e.at)
            loss = ev.loss_of(e.metrics)
            who.losses.append(math.nan if loss is None else loss)
            who.stall_s = max(who.stall_s, e.stall_s)
        elif isinstance(e, ev.CheckpointCommitted):
            who.commits.append(e)
        if e is who.end_event or isinstance(e, ev.Progress | ev.Restored | ev.CheckpointCommitted):
            who.alive_until = max(who.alive_until, e.at)


def _ends(s: ev.Started, e: Event) -> bool:
    run_over = isinstance(e, ev.Completed | ev.Failed | ev.Cancelled | ev.Paused)
    mine = (
        isinstance(e, ev.Preempted | ev.AttemptFailed | ev.Fenced | ev.RankLost | ev.Guarded)
        and e.worker == s.worker
    )
    return run_over or (mine and getattr(e, "token", s.token) == s.token)  # fenced has one
