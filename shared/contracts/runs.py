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
    step: int = 0
    """Step of the newest committed checkpoint."""
    digest: str | None = None
    """sha256 over the final weights, set on COMPLETED."""
    metrics: dict[str, float] = {}
    reason: str | None = None


def run_id_for(idempotency_key: str) -> str:
    """Run ids are a pure function of the idempotency key, so a submitter knows the id
    before the dispatcher has seen the job, and a repeated key can only name one run."""
    return "r" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:20]


def spec_hash(spec: JobSpec) -> str:
    without_key = msgspec.structs.replace(spec, idempotency_key=None)
    return hashlib.sha256(encode(without_key)).hexdigest()[:16]
