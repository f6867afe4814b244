"""What the scheduler knows of a pool, and what it decides: plain values, no I/O.

The scheduler's service (`services/dispatcher/scheduler.py`) builds a `PoolState` from the
run records and heartbeats it follows, asks `plan` for decisions, and carries them out by
compare-and-swap on the records — so everything here is a pure function of its inputs,
benchmarked (`bench/scheduler.py`) and tested without a broker.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from shared.contracts.pools import Pool
from shared.scheduling.horizon import Horizon, Work


class Phase(enum.Enum):
    QUEUED = "queued"
    """Waiting for the scheduler: no task anywhere yet."""
    ADMITTED = "admitted"
    """Its task is in the work queue (or its grant at a site): a trainer will take it."""
    RUNNING = "running"
    """Trained (or between two attempts: handing over) on `ranks` trainers."""
    LEAVING = "leaving"
    """Asked to make room for another run: its trainers are promised to that run."""


@dataclass(slots=True)
class Run:
    """One run of the pool that is not over, as the scheduler sees it."""

    run_id: str
    owner: str
    priority: int
    order: float
    """Its age: earlier first (the record's `created_at`; the run id breaks ties)."""
    phase: Phase
    min_ranks: int = 1
    max_ranks: int = 1
    ranks: int = 0
    """Trainers it holds (RUNNING), or is allotted (ADMITTED); 0 while QUEUED."""
    cap: int | None = None
    """An elastic run's `ranks_cap`: the most it may hold now (None: its `max_ranks`)."""
    running_since: float | None = None
    """When it started on its trainers, on the scheduler's clock: `min_run_s` counts from it."""
    unsaved: int = 0
    """Steps since its newest committed checkpoint (its trainers' heartbeats say)."""
    site: str = ""
    """The site it is granted to ("" = the hub's)."""
    grantable: bool = False
    """A run a site may be granted (of a fixed size, asked nothing)."""
    replica: bool = False
    """A replica of a replicated run: granted only where a trainer is free for it now."""
    work: Work | None = None
    """What its expected seconds are reckoned from (grants by time: `horizon`)."""

    @property
    def elastic(self) -> bool:
        return self.min_ranks < self.max_ranks

    @property
    def holds(self) -> int:
        """Trainers it counts against the pool: held or allotted, unless leaving (a run
        granted to a site ahead of need holds none until it trains there)."""
        if self.phase is Phase.RUNNING or (self.phase is Phase.ADMITTED and not self.site):
            return self.ranks
        return 0


@dataclass(slots=True)
class SiteRoom:
    free: int
    """Ranks the site may still be granted (per live trainer there: the one it trains and
    `BATON_DELEGATE_AHEAD` more, less the ranks of the runs it holds)."""
    spare: int = 0
    """The part of `free` that is ahead of need: never granted to a replica."""
    time: Horizon | None = None
    """Granted by time (`horizon`): the expected seconds it may still be granted, which
    bound what is granted ahead of need; None: granted by count (`free` alone)."""

    def open(self) -> bool:
        """Whether a run may still be granted here: ranks left, and time left or a trainer
        free now."""
        if self.free <= 0:
            return False
        return self.time is None or self.time.fits() or self.free > self.spare


@dataclass(slots=True)
class PoolState:
    name: str
    policy: Pool
    trainers: int
    """Live trainers of the pool, not drained: at the hub, and at sites (a site's trainer
    takes the hub's work when its own queue of granted runs is empty)."""
    runs: list[Run]
    """The runs holding trainers or promised them: admitted, training, leaving."""
    queued: Mapping[str, Sequence[Run]] = field(default_factory=dict)
    """Each owner's queued runs, highest priority then oldest first (`queue_order`). Read
    only: a pass never changes them (the scheduler keeps them from one pass to the next)."""
    priorities: Counter[int] = field(default_factory=Counter)
    """How many runs are queued at each priority."""
    usage: dict[str, float] = field(default_factory=dict)
    """Each owner's decayed trainer-seconds in the pool (`shares.Usage`)."""
    sites: dict[str, SiteRoom] = field(default_factory=dict)
    hub_free: int = 0
    """The hub's own trainers of the pool free now (its trainers less the ranks of the runs
    it holds): what a site granted by time never takes a run ahead of need from."""
    speeds: Mapping[str, float] = field(default_factory=dict)
    """Measured seconds per step of the pool's job names (`horizon.expected_s`)."""
    now: float = 0.0
    """The scheduler's monotonic clock."""

    @classmethod
    def of(cls, name: str, policy: Pool, trainers: int, runs: list[Run], **kw: object) -> PoolState:
        """A pool's state from all its runs, queued or not (what a test writes)."""
        queued: dict[str, list[Run]] = {}
        for r in runs:
            if r.phase is Phase.QUEUED:
                queued.setdefault(r.owner, []).append(r)
        state = cls(
            name, policy, trainers, [r for r in runs if r.phase is not Phase.QUEUED],
            {o: sorted(rs, key=queue_order) for o, rs in queued.items()},
            Counter(r.priority for r in runs if r.phase is Phase.QUEUED),
        )  # fmt: skip
        for k, v in kw.items():
            setattr(state, k, v)
        return state

    def all_queued(self) -> list[Run]:
        return [r for rs in self.queued.values() for r in rs]


def queue_order(r: Run) -> tuple[int, float, str]:
    """An owner's queued runs are taken in this order: highest priority, then oldest."""
    return (-r.priority, r.order, r.run_id)


class SavedUsage(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's usage per owner as the scheduler kept it (the pools bucket, `usage.<pool>`),
    so that a restarted dispatcher does not forget who used the pool."""

    owners: dict[str, float]
    at: float
    """The writer's wall clock: what the values decay by until read back."""


@dataclass(frozen=True, slots=True)
class Admit:
    """Publish the run's task: `ranks` trainers are counted for it (an elastic run's cap)."""

    run_id: str
    ranks: int
    cap: int | None = None


@dataclass(frozen=True, slots=True)
class Grant:
    """Grant the run to `site` (`services/dispatcher/delegation.py`)."""

    run_id: str
    site: str


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask the attempt holding `run_id` to make room for `by`: checkpoint and requeue it
    (`to_ranks` 0), or re-form its elastic group with `to_ranks` ranks."""

    run_id: str
    by: str
    kind: str
    reason: str
    to_ranks: int = 0


@dataclass(frozen=True, slots=True)
class Cap:
    """Let an elastic run grow to `ranks` (trainers nothing queued can use)."""

    run_id: str
    ranks: int


Action = Admit | Grant | Preempt | Cap


@dataclass(slots=True)
class Plan:
    actions: list[Action] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)
    """Queued runs looked at and left waiting, with why (`baton queue`)."""
    waiting: dict[str, str] = field(default_factory=dict)
    """The same, in words that do not move with every number (what their records say)."""
