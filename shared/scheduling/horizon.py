"""Grants by time: how much queued work a site holds ahead, reckoned in expected seconds.

Invariant: a site with a horizon of H seconds is granted a run of a pool only while the
expected trainer-seconds it holds of that pool — what is left of each run it trains, and
each run granted to it and not started — are below H times its live trainers of the pool,
and while it holds fewer than `MOST_AHEAD` runs per trainer beyond the one each trains (a
pool of tiny runs is never granted thousands). Without a horizon a site is granted in runs
(`BATON_DELEGATE_AHEAD`), as before.

A run's expected seconds: the steps it has left times the median seconds per step of the
last completed runs of its job name in its pool (`shared.state.pools.JobSpeeds`), else
its job's `estimate_s` for those steps, times its ranks; a run nobody can estimate counts
half the horizon, so a trainer training one is granted one more — what the runs count
grants by default. Pure: the scheduler (`services/dispatcher/queues.py`) reads the speeds
and the records, and a pass (`plan.py`) decides on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MOST_AHEAD = 128
"""Runs a site holds per live trainer of a pool beyond the one each trains, at most, when
granted by time: enough for a 30-minute horizon of 15-second runs (a ceiling of 32 bounded
a 900 s horizon of 20-second runs to about 660 s of work per trainer), and no pool of
tiny runs is granted thousands."""


@dataclass(frozen=True, slots=True)
class Work:
    """What a run's expected seconds are reckoned from."""

    job: str
    """Its job's name: whose measured speeds count."""
    steps: int
    """Steps it has left to train."""
    total_steps: int
    estimate_s: float | None = None
    """Its job's `estimate_s` (for all its steps), if it gave one."""
    ranks: int = 1


def expected_s(work: Work, speeds: Mapping[str, float]) -> float | None:
    """Trainer-seconds `work` is expected to take (the module's docstring); None when
    neither its job's measured speed (`speeds`, by job name) nor an estimate says."""
    left = max(0, work.steps)
    step_s = speeds.get(work.job)
    if step_s is not None:
        return left * step_s * work.ranks
    if work.estimate_s is not None and work.total_steps > 0:
        return work.estimate_s * left / work.total_steps * work.ranks
    return None


def cost(expected: float | None, horizon_s: float) -> float:
    """What a run counts against a site's horizon: its expected seconds, or half the
    horizon for a run nobody can estimate."""
    return horizon_s / 2 if expected is None else expected


@dataclass(slots=True)
class Horizon:
    """A site's room for one pool, by time."""

    horizon_s: float
    """Seconds of expected work per trainer the site is granted up to."""
    seconds: float
    """Expected trainer-seconds it may still be granted (below 0: none)."""

    def fits(self) -> bool:
        return self.seconds > 0

    def take(self, expected: float | None) -> None:
        self.seconds -= cost(expected, self.horizon_s)


def room(trainers: int, horizon_s: float, held: list[float | None]) -> Horizon:
    """A site's room: `trainers` live trainers of the pool there, a horizon of `horizon_s`
    seconds each, and the expected seconds of the runs it holds (`held`, None for a run
    nobody can estimate)."""
    used = sum(cost(e, horizon_s) for e in held)
    return Horizon(horizon_s=horizon_s, seconds=trainers * horizon_s - used)


def per_trainer(trainers: int, held: list[float | None], horizon_s: float) -> float | None:
    """Seconds of expected work a site holds per live trainer (`baton sites`); None with
    no trainer of the site live."""
    if trainers <= 0:
        return None
    return sum(cost(e, horizon_s) for e in held) / trainers
