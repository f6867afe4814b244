"""Requests that steer runs: cancel (a user's), and commands to a trainer (the reaper's)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID


class CancelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    reason: Annotated[str, Meta(max_length=512)] = "cancelled by user"


class Command(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sent on core NATS to `baton.control.<worker>`. `wake`: look at the run record now
    (it changed). `kill`: the worker runs `run_id` without holding its lease — an orphan —
    so its training process must die. Losing a command costs only latency: the record and
    the lease stay the truth, and the sweeps repeat."""

    run_id: str
    action: Literal["wake", "kill"]
    reason: str = ""


class WorkerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A trainer's heartbeat in the `baton_workers` bucket (expires by server TTL)."""

    worker: str
    pool: str
    host: str
    pid: int
    device: str
    """`cpu`, or `cuda:<index>`: the GPU (nvidia-smi's index on the host) its training
    processes use."""
    gpu_name: str = ""
    gpu_memory_bytes: int = 0
    run_id: str | None = None
    token: int | None = None
    step: int | None = None
    site: str = ""
    """The site the trainer runs at; empty at the hub."""
    rank: int | None = None
    """The rank it holds of a run of several ranks (`token` is then the group's epoch)."""
    at: float
