"""Where a run's wall time went, the way ML goodput is measured.

The wall time, from `accepted` to the run's end (or to now, for a live run), is split into
categories that add up to it exactly (`other` takes any remainder, which is 0 when every
event is where it should be). Against Google's ml-goodput-measurement:

    queued       accepted -> the first attempt started              (scheduling; theirs starts
                                                                     at the job's start)
    startup      an attempt started -> its checkpoint lookup began:  PROGRAM_STARTUP and
                 the training process taking the task, importing    TRAINING_PREP
                 the entry point, building the model
    restore      finding, reading and loading the checkpoint        UNPRODUCTIVE_CHECKPOINT_
                                                                     RESTORE_TIME
    productive   steps whose progress was kept                      goodput
    checkpoint   the training loop blocked by checkpoint snapshots, UNPRODUCTIVE_CHECKPOINT_
                 and the final (or preemption) commit               SAVE_TIME
    wasted       steps computed again by a later attempt (the       WASTED_PROGRESS_FROM_
                 attempt got past the commit the next one resumed)   DISRUPTION
    recovery     an attempt's last sign of life -> the next attempt  INFRASTRUCTURE_RECOVERY_
                 started (noticing the death, handing over)          FROM_DISRUPTION
    rounds       a replica's steps standing still for its run's     (DiLoCo's communication
                 outer rounds (`round` events' `waited_s`)           time)

Steps are timed by the attempt's own progress events: an attempt's step time is the time
between its restore and its last progress, less its checkpoint stalls, over the steps it
computed; its wasted time is that step time times the steps redone. Data loading is not
told apart from computing: it is part of a step.

Every time here is subtracted from another, so the events must be on one clock: read them
through `shared.history.clocks` (`from_messages`, `on_hub_clock`), which puts them on the hub's
and keeps each attempt's own durations as its trainer measured them. Raw events of hosts
whose clocks differ would give phantom durations as long as that difference. A live run
lasts until `now`, which must be on the same clock: by default its newest event, which
reads no clock at all.

`goodput` = productive / wall.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.history.timeline import Attempt, attempts_of

CATEGORIES = (
    "queued", "startup", "restore", "productive", "checkpoint", "wasted", "recovery", "rounds",
    "other",
)  # fmt: skip


class Goodput(msgspec.Struct, frozen=True, kw_only=True):
    wall_s: float
    queued_s: float = 0.0
    startup_s: float = 0.0
    restore_s: float = 0.0
    productive_s: float = 0.0
    checkpoint_s: float = 0.0
    wasted_s: float = 0.0
    recovery_s: float = 0.0
    rounds_s: float = 0.0
    other_s: float = 0.0
    steps_redone: int = 0
    attempts: int = 0
    finished: bool = False
    """The run is over: the numbers will not change any more."""

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | bool]:
        """What `--json` and the dashboard show: the ratio, the wall time and each category."""
        return {
            "goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
            **{f"{c}_s": round(v, 3) for c, v in self.seconds().items()},
            "steps_redone": self.steps_redone, "attempts": self.attempts,
            "finished": self.finished,
        }  # fmt: skip

    def seconds(self) -> dict[str, float]:
        return {c: float(getattr(self, f"{c}_s")) for c in CATEGORIES}

    def __add__(self, other: Goodput) -> Goodput:
        """The sum over runs (what `baton goodput` totals)."""
        fields = {f"{c}_s": getattr(self, f"{c}_s") + getattr(other, f"{c}_s") for c in CATEGORIES}
        return Goodput(
            wall_s=self.wall_s + other.wall_s, **fields,
            steps_redone=self.steps_redone + other.steps_redone,
            attempts=self.attempts + other.attempts, finished=self.finished and other.finished,
        )  # fmt: skip


END = (ev.Completed, ev.Failed, ev.Cancelled)


def goodput(events: list[Event], now: float | None = None) -> Goodput | None:
    """The split of a run's wall time, from its events in stream order, all on one clock
    (the module's docstring); None without any. A live run's `now` is on that clock too,
    and defaults to its newest event's time."""
    if not events:
        return None
    begin = next((e.at for e in events if isinstance(e, ev.Accepted)), events[0].at)
    ending = next((e for e in events if isinstance(e, END)), None)
    end = ending.at if ending else (max(e.at for e in events) if now is None else now)
    wall = max(0.0, end - begin)
    split = per_attempt(events, now)
    if not split:
        return Goodput(wall_s=wall, queued_s=wall, finished=ending is not None)
    parts = dict.fromkeys(CATEGORIES, 0.0)
    parts["queued"] = max(0.0, split[0].attempt.started.at - begin)
    for share in split:
        for c, v in share.parts.items():
            parts[c] += v
    # A round's wait is inside an attempt's steps: taken out of what they produced.
    waited = sum(e.note.waited_s for e in events if isinstance(e, ev.Round))
    parts["rounds"] = min(waited, parts["productive"])
    parts["productive"] -= parts["rounds"]
    parts["other"] = wall - sum(parts.values())
    return Goodput(
        wall_s=wall, **{f"{c}_s": v for c, v in parts.items()},
        steps_redone=sum(s.redone for s in split), attempts=len(split),
        finished=ending is not None,
    )  # fmt: skip


@dataclass(frozen=True)
class Share:
    """One attempt's part of its run's time (`per_attempt`)."""

    attempt: Attempt
    parts: dict[str, float]
    """Its seconds by category: startup, restore, productive, checkpoint, wasted; and
    `recovery`, from its end to the next attempt's start."""
    redone: int
    """Steps it computed that the next attempt computed again."""


def per_attempt(events: list[Event], now: float | None = None) -> list[Share]:
    """Each attempt of the run whose events are `events` (as for `goodput`) with its own
    part of the run's time; `goodput` is their sum (with the queue before the first, round
    waits taken out of the productive time and the remainder as `other`)."""
    if not events:
        return []
    ending = next((e for e in events if isinstance(e, END)), None)
    end = ending.at if ending else (max(e.at for e in events) if now is None else now)
    attempts = attempts_of(events)
    out = []
    for i, a in enumerate(attempts):
        parts = dict.fromkeys(CATEGORIES, 0.0)
        nxt = attempts[i + 1].started.at if i + 1 < len(attempts) else None
        until = _until(a, nxt, end, live=ending is None)
        following = attempts[i + 1] if nxt is not None else None
        redone = _account(a, following, until, parts, live=ending is None and nxt is None)
        if nxt is not None:
            parts["recovery"] += max(0.0, nxt - until)
        out.append(Share(a, parts, redone))
    return out


def _until(a: Attempt, nxt: float | None, end: float, live: bool) -> float:
    """Where attempt `a`'s own time ends: its last sign of life, never past the next
    attempt's start (a fenced zombie's overlap is not wall time) nor the run's end; a live
    run's current attempt lasts until now."""
    last = end if live and nxt is None else a.alive_until
    return max(a.started.at, min(last, nxt if nxt is not None else end, end))


def _account(
    a: Attempt, nxt: Attempt | None, until: float, parts: dict[str, float], live: bool
) -> int:
    """Add attempt `a`'s time from its start to `until` to `parts`; return its steps redone.
    A live attempt's time since its last progress is training not yet reported."""
    start = a.started.at
    ready = min(until, a.resumed.at if a.resumed else (a.times[0] if a.times else until))
    restore = min(a.resumed.restore_s if a.resumed else 0.0, ready - start)
    parts["restore"] += restore
    parts["startup"] += ready - start - restore
    last_at = min(until, max([ready, *a.times]))
    training = last_at - ready
    stall = min(a.stall_s, training)
    computing = training - stall
    parts["checkpoint"] += stall + (0.0 if live else until - last_at)  # the closing commit
    done = (max(a.steps) if a.steps else a.first_step) - a.first_step
    redone = 0 if nxt is None else max(0, min(done, a.first_step + done - nxt.first_step))
    wasted = computing * redone / done if done > 0 else 0.0
    parts["wasted"] += wasted
    parts["productive"] += computing - wasted + (until - last_at if live else 0.0)
    return redone
