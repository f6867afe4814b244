"""The pools' configuration: what a step costs, who may use a pool how much and how urgently.

One TOML file (`BATON_POOLS_FILE`, or `baton pools apply FILE`) holds a `[pools.<name>]`
table per pool; every service follows its newest applied version live
(`shared.state.policy`), so a change takes effect without restarting anything:

    [pools.gpu]
    rate_per_hour = 2.0                 # budgets (`limits.max_cost`)
    priorities = { low = -10, normal = 0, high = 10 }
    max_priority = 0                    # the highest an owner not listed may ask for
    min_run_s = 60                      # no preemption before a run had this long
    price = { cuda = 0.0008, cpu = 0.0001 }   # credits per trainer-second
    [pools.gpu.fair_share]
    half_life_s = 3600
    margin = 0.5
    [pools.gpu.owners.alice]
    weight = 2                          # her share against the others' (and her team's)
    quota = 4                           # trainers (ranks count) before she borrows
    max_priority = 10
    team = "vision"
    [pools.gpu.teams.vision]
    weight = 3

The scheduling rules these feed are in `shared.scheduling` (docs/scheduling.md).
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import Disconnect, OnFailure

OWNER = r"^[A-Za-z0-9_-]{1,64}$"
"""An owner: a submitter's user name, a token of every subject about its runs."""

Priority = Annotated[int, Meta(ge=-1000, le=1000)]
Weight = Annotated[float, Meta(gt=0, le=1e6)]
Price = Annotated[float, Meta(ge=0, le=1e6)]
Credits = Annotated[float, Meta(ge=0, le=1e12)]


class FairShare(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How owners share a saturated pool. Usage is trainer-seconds, halved every
    `half_life_s`; an owner below its share of the pool's trainers by more than `margin`
    trainers reclaims from the owner most above its own, by preemption, as long as that
    owner keeps at least its share less `margin`."""

    half_life_s: Annotated[float, Meta(gt=0, le=365 * 86400)] = 3600.0
    margin: Annotated[float, Meta(ge=0, le=1e6)] = 0.5


class Owner(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One person's (or a team account's) terms on a pool."""

    weight: Weight = 1.0
    quota: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None
    """Trainers (each rank counts) the owner may hold before it borrows: beyond it, only
    idle trainers, which are reclaimed by preemption when an owner within its quota needs
    them. None: no quota."""
    max_priority: Priority | None = None
    """The highest priority the owner may submit at; None: the pool's `max_priority`."""
    team: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,64}$")] = ""
    """Owners of one team share the team's weight (`Pool.teams`); "" is a team of one."""
    overdraft: Credits | None = None
    """The owner's overdraft; None: the pool's (`Pool.overdraft`)."""


class Team(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    weight: Weight = 1.0


class Pool(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rate_per_hour: float = 0.0
    """What an hour of one trainer of this pool costs, in `limits.max_cost`'s unit."""
    seconds_per_step: float | None = None
    """Configured first guess; replaced by measurements once runs complete."""
    on_failure: OnFailure = "retry"
    """What a failure of user code leads to for a job that does not say
    (`shared.contracts.jobs.OnFailure`)."""
    disconnect: Disconnect = Disconnect()
    """What the hub does with this pool's runs granted to a site that falls silent, for a
    job that does not say (`shared.contracts.jobs.Disconnect`)."""

    priorities: dict[Annotated[str, Meta(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")], Priority] = {}
    """Priority classes a job may name instead of a number (`priority = "high"`)."""
    default_priority: Priority = 0
    """A job's priority when it names none."""
    max_priority: Priority = 0
    """The highest priority an owner may submit at unless `owners` says otherwise;
    operators (runs without an owner) may use any."""
    owners: dict[Annotated[str, Meta(pattern=OWNER)], Owner] = {}
    teams: dict[Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")], Team] = {}
    fair_share: FairShare = FairShare()
    preemption: bool = True
    """Whether the scheduler may preempt runs of this pool at all (priority, quota, fair
    share); a preemption checkpoints the run and costs it no step."""
    min_run_s: Annotated[float, Meta(ge=0, le=30 * 86400)] = 60.0
    """A run is never preempted before it had this long on its trainers (no thrashing)."""
    price: dict[Annotated[str, Meta(pattern=r"^[a-z*][a-z0-9_-]{0,31}$")], Price] = {}
    """Credits per trainer-second, by device kind (`cpu`, `cuda`; `*` for any other). A
    pool with a price holds each owned run's estimated cost at submit and settles it at
    the end (`shared.ledger`); without one, its runs cost no credits."""
    estimate_margin: Annotated[float, Meta(ge=1, le=100)] = 1.25
    """A run's hold is its estimated trainer time times this."""
    overdraft: Credits = 0.0
    """Credits an owner's balance may go below zero — by runs nothing was held for (a
    site's submissions, priced as the hub takes them in) and pauses at budget that came a
    checkpoint late — before that owner's runs nothing was held for are paused (`budget:
    …`, resumed after a top-up, holding then). 0: paused as soon as it is below zero."""
    grant_ahead_s: Annotated[float, Meta(ge=0, le=30 * 86400)] | None = None
    """Grants by time for this pool (docs/sites.md): seconds of expected work per trainer
    a site is granted ahead, where `BATON_GRANT_AHEAD_S` names no value for that site.
    None: the variable's default, else grants counted in runs."""

    def owner(self, name: str) -> Owner:
        """`name`'s terms (defaults for an owner not listed)."""
        return self.owners.get(name) or Owner()

    def highest_priority(self, owner: str) -> int | None:
        """The highest priority `owner` may submit at; None: any (an operator's run)."""
        if not owner:
            return None
        found = self.owner(owner).max_priority
        return self.max_priority if found is None else found

    def overdraft_of(self, owner: str) -> float:
        """Credits `owner`'s balance may go below zero (`overdraft`)."""
        found = self.owner(owner).overdraft
        return self.overdraft if found is None else found

    def priced(self) -> bool:
        return any(p > 0 for p in self.price.values())

    def price_of(self, device: str) -> float:
        """Credits per trainer-second on a trainer of `device` (`cpu`, `cuda:0`…)."""
        kind = device.partition(":")[0]
        return self.price.get(kind, self.price.get("*", 0.0))

    def dearest(self) -> float:
        """The highest price of the pool: what a hold is reckoned at (the trainer a run
        will get is not known when it is submitted; the settlement charges the real one)."""
        return max(self.price.values(), default=0.0)

    def team_of(self, owner: str) -> str:
        """`owner`'s team, or a team of its own (`@owner`: no team name holds an `@`)."""
        return self.owner(owner).team or f"@{owner}"

    def team_weight(self, team: str) -> float:
        if team.startswith("@"):
            return self.owner(team[1:]).weight
        found = self.teams.get(team)
        return found.weight if found is not None else 1.0


class PoolTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pools: dict[str, Pool] = {}

    def pool(self, name: str) -> Pool:
        return self.pools.get(name) or self.pools.get("*") or Pool()


UNITS_PER_CREDIT = 1_000_000
"""Credits are kept as whole micro-credits (`units`): every ledger amount is an integer,
so a balance adds up to the unit whatever the order of its entries."""


def units(credits: float) -> int:
    """`credits` in whole units, rounded half away from zero."""
    scaled = credits * UNITS_PER_CREDIT
    return math.floor(abs(scaled) + 0.5) * (1 if scaled >= 0 else -1)


def credits(amount: int) -> str:
    """`amount` units as credits, for people: `12.5`, `0.000001`, `-3`."""
    whole, frac = divmod(abs(amount), UNITS_PER_CREDIT)
    text = f"{whole}.{frac:06d}".rstrip("0").rstrip(".")
    return f"-{text}" if amount < 0 else text
