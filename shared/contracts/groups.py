"""A run of several ranks: the leader's calls for ranks, and the group's keys in KV.

The trainer that took the run's task leads its group as rank 0. Its lease token is the
group's epoch. It publishes one `RankCall` per other rank on the pool's work queue and keeps
one `GroupKey` in the groups bucket while the group lives; each trainer that takes a call
keeps one `MemberKey` there. Every key has a short server-side TTL and is renewed by its
writer, so a trainer's silence shows as a missing key within seconds
(`services/trainer/group.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.contracts.tasks import Task


class RankCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Published by a group's leader on `baton.calls.<pool>.<run>`: hold `rank` of the group
    `epoch`. A call for an epoch that is no longer the group's is dropped on sight."""

    task: Task
    epoch: Annotated[int, Meta(ge=1)]
    rank: Annotated[int, Meta(ge=1, le=63)]
    """The slot called for: its member key's name. In an elastic run's group the ranks are
    renumbered by slot among those held when it forms (`GroupKey.members`)."""
    grow: bool = False
    """An elastic group training below its `max` offers a rank: whoever holds it makes the
    group stop at its next step boundary and form again, larger."""


class GroupKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The group of a run, written by its leader: forming until `port` is set, then training.
    `priority` orders groups that compete for a pool's trainers: the older run forms first."""

    run_id: str
    pool: str
    epoch: int
    ranks: int
    """The group's size: the most it may have while forming, what it has once formed."""
    leader: str
    priority: float
    """The run's submission time (its record's `created_at`)."""
    addr: str = ""
    port: int = 0
    """Rank 0's store; set once every rank is held and rank 0's process listens."""
    members: list[str] = []
    hosts: list[str] = []
    """Workers and their hosts by rank, once formed."""

    @property
    def formed(self) -> bool:
        return self.port > 0

    def older_than(self, other: GroupKey) -> bool:
        return (self.priority, self.run_id) < (other.priority, other.run_id)


class MemberKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One rank's trainer in a group. `state`: joined (waiting for the group to form),
    running (its process trains), exited (its process ended: `code`, and the tail of its
    output when it failed)."""

    run_id: str
    epoch: int
    rank: int
    worker: str
    host: str
    state: Literal["joined", "running", "exited"] = "joined"
    code: int | None = None
    user_error: bool = False
    """The process ended because the user's code raised (not killed, not a peer lost)."""
    tail: str = ""
    step: int = 0
    site: str = ""
    """The site its trainer runs at; "" at the hub."""
