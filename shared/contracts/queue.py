"""A pool's queue as the scheduler answers for it (`baton queue`, the dashboard): core NATS
request and reply on `baton.queue.<pool>`, answered by the dispatcher's scheduler."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import TOKEN


class QueueRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    limit: Annotated[int, Meta(ge=1, le=2000)] = 200
    """Queued runs to list at most, from the front (`QueueView.more` counts the rest)."""


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """A run not training yet, at `position` (0: next) of its pool's queue."""

    run_id: str
    owner: str
    priority: int
    position: int
    state: str
    """`queued` (waiting for the scheduler) or `admitted` (a trainer takes it next)."""
    ranks: int
    waiting: str
    """Why it waits, in a person's words."""
    queued_s: float
    """Seconds since it was submitted (or last requeued: `preemptions` says how often)."""
    preemptions: int = 0


class Training(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    owner: str
    priority: int
    ranks: int
    worker: str = ""
    site: str = ""
    leaving: str = ""
    """Why it is making room for another run, while it is."""
    preemptions: int = 0


class OwnerShare(msgspec.Struct, frozen=True, kw_only=True):
    owner: str
    weight: float
    team: str
    share: float
    """Its share of the pool now, among the owners active in it (0 to 1)."""
    entitled: float
    """Its share of the hub's trainers."""
    holding: int
    """Trainers its runs hold now."""
    usage_s: float
    """Its decayed trainer-seconds (half-life: the pool's `fair_share.half_life_s`)."""
    quota: int | None = None
    max_priority: int | None = None
    preempted: int = 0
    """Its runs' preemptions by the scheduler, among the runs not over."""


class QueueView(msgspec.Struct, frozen=True, kw_only=True):
    pool: Annotated[str, Meta(pattern=TOKEN)]
    trainers: int
    """Live trainers of the pool at the hub, not drained."""
    free: int
    waiting: list[Waiting] = []
    training: list[Training] = []
    owners: list[OwnerShare] = []
    more: int = 0
    """Queued runs after the last listed."""
