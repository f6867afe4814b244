"""The run record: the truth about a run. Queues only trigger work; this decides it."""

from __future__ import annotations

import enum
import hashlib

import msgspec

from shared.contracts.codec import encode
from shared.contracts.jobs import JobSpec


class RunState(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


class RunRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    run_id: str
    spec: JobSpec
    spec_hash: str
    state: RunState = RunState.QUEUED
    created_at: float
    updated_at: float
    dispatch: int = 1
    attempts: int = 0
    """Training attempts started (every lease acquisition starts one)."""
    retries: int = 0
    """Failures of user code so far; compared with `spec.limits.max_retries`."""
    worker: str | None = None
    token: int | None = None
    delivery: str | None = None
    """The reply subject of the task delivery that the attempt holding `token` answers, while
    `worker` is set: whoever learns that attempt is dead naks it, so the task is delivered
    again at once instead of after its AckWait (`shared.state.handover`)."""
    step: int = 0
    """Step of the newest committed checkpoint."""
    digest: str | None = None
    """sha256 over the final weights, set on COMPLETED."""
    metrics: dict[str, float] = {}
    reason: str | None = None
    """Why the run is FAILED or CANCELLED."""
    cancel_requested: str | None = None
    """Set while a RUNNING run is asked to cancel; its trainer checkpoints and stops."""
    stop_token: int | None = None
    stop_reason: str | None = None
    """The reaper's order to stop the attempt holding `stop_token` (a stall); the attempt
    counts as failed, so the run is retried while it has retries left."""
    warned: list[str] = []
    """Warnings already emitted (`soft_timeout`, `stalled`), so each is emitted once."""
    deadline_at: float | None = None
    soft_deadline_at: float | None = None
    """Wall-clock seconds on the dispatcher's clock, set once with `created_at`: only their
    difference from `created_at` (the limit) is used, against how long ago the hub's server
    stamped the run's first `accepted` event (`services/reaper/clock.py`). No correctness
    depends on them."""
    estimated_cost: float | None = None
    actual_cost: float = 0.0
    busy_s: float = 0.0
    """Seconds of training attempts so far, each measured on its trainer's own clock."""
    announce_pending: bool = False
    """Set with the terminal state and cleared once the terminal event is stored; a record
    that keeps it is repaired by the reaper (`shared.state.endings`)."""
    ending_site: str = ""
    """The site whose outbox carries the terminal event ("" for the hub)."""
    waiting: str | None = None
    """Why a QUEUED run of several ranks is not training yet (its group is forming, or gave
    way to an older one); cleared when it starts."""
    group: list[str] = []
    """The workers holding the run's ranks, by rank, while a group of several trains."""
    group_size: int = 0
    """How many ranks the run trained with last (0 before its first attempt): an elastic
    run's group that forms at another size has been resized."""


def run_id_for(idempotency_key: str, owner: str = "") -> str:
    """Run ids are a pure function of the idempotency key (and its submitter), so a
    submitter knows the id before the dispatcher has seen the job, and a repeated key can
    only name one run.

    A submitter's runs are `<owner>.r<hash>`: the owner is a subject token of every subject
    about the run, which is how the servers let a submitter read its own runs' events and
    no one else's (`shared.auth`); the owner comes from the subject the servers let it
    submit on. Operators' (and hand-published) submissions carry no owner.

    Total over every `str`: a rejected submission's raw key may hold a lone surrogate (JSON
    can escape one, argv can carry one), and filing its rejection must not fail on it."""
    data = idempotency_key.encode("utf-8", "surrogatepass")
    run = "r" + hashlib.sha256(data).hexdigest()[:20]
    return f"{owner}.{run}" if owner else run


_ADDED_LATER = {"ranks": 1, "collective_timeout_s": 60.0}
"""Spec fields added after checkpoints were first written, with their defaults: left out of
the hash while at their default, so a run's checkpoints keep matching its spec across
versions."""


def spec_hash(spec: JobSpec) -> str:
    fields = msgspec.to_builtins(msgspec.structs.replace(spec, idempotency_key=None))
    for name, default in _ADDED_LATER.items():
        if fields.get(name) == default:
            del fields[name]
    return hashlib.sha256(encode(fields)).hexdigest()[:16]
