"""Fair shares: who is entitled to how many of a pool's trainers, and who used how much.

**Shares.** Among the owners active in a pool now (a run queued or holding trainers there),
each team gets the pool in proportion to its weight, and each owner its team's part in
proportion to its own weight; an owner without a team is a team of one, of its own weight
(`Pool.team_of`). An owner's *entitlement* is its share times the pool's trainers.

**Usage** is trainer-seconds, decayed by half every `half_life_s`, so that what an owner
used an hour ago weighs half what it used just now (Slurm's fair-share usage). Its
*standing* is its usage over its share: the next trainer goes to the owner lowest there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from shared.contracts.pools import Pool


def shares(policy: Pool, owners: Iterable[str]) -> dict[str, float]:
    """Each of `owners`' share of the pool (they add up to 1)."""
    teams: dict[str, list[str]] = defaultdict(list)
    for o in sorted(set(owners)):
        teams[policy.team_of(o)].append(o)
    total = sum(policy.team_weight(t) for t in teams)
    out: dict[str, float] = {}
    for team, members in teams.items():
        part = policy.team_weight(team) / total
        weights = {o: policy.owner(o).weight for o in members}
        inside = sum(weights.values())
        for o, w in weights.items():
            out[o] = part * w / inside
    return out


class Usage:
    """Decayed trainer-seconds per owner of one pool. Invariant: `value(o, t)` is every
    trainer-second `o` was given at times `s ≤ t`, each weighted `2^-((t - s) / half_life)`."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._used: dict[str, tuple[float, float]] = {}  # owner -> (value, at)

    def _decay(self, value: float, dt: float) -> float:
        return value * math.pow(2.0, -max(0.0, dt) / self.half_life_s)

    def add(self, owner: str, trainer_s: float, now: float) -> None:
        value, at = self._used.get(owner, (0.0, now))
        self._used[owner] = (self._decay(value, now - at) + trainer_s, now)

    def value(self, owner: str, now: float) -> float:
        value, at = self._used.get(owner, (0.0, now))
        return self._decay(value, now - at)

    def values(self, now: float) -> dict[str, float]:
        return {o: self.value(o, now) for o in self._used}

    def retune(self, half_life_s: float) -> None:
        """A new half-life from the pool's table: what was used so far is kept as it is."""
        self.half_life_s = half_life_s

    def snapshot(self, now: float) -> dict[str, float]:
        """The values now, for keeping across a restart (`restore`)."""
        return {o: v for o, v in self.values(now).items() if v > 1e-9}

    def restore(self, saved: dict[str, float], age_s: float, now: float) -> None:
        """Values saved `age_s` ago (`snapshot`), decayed by that long."""
        for owner, value in saved.items():
            self._used[owner] = (self._decay(value, age_s), now)
