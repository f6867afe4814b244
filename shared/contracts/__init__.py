"""Every message and stored object in Baton, as frozen msgspec Structs."""

from shared.contracts.checkpoints import CommitRequest, FileRef, Manifest, Pointer
from shared.contracts.codec import convert, decode, encode
from shared.contracts.jobs import CheckpointPolicy, JobSpec, Limits, RankRange, job_schema
from shared.contracts.records import RunRecord, RunState, Skip, run_id_for, spec_hash
from shared.contracts.tasks import Task

__all__ = [
    "CheckpointPolicy",
    "CommitRequest",
    "FileRef",
    "JobSpec",
    "Limits",
    "Manifest",
    "Pointer",
    "RankRange",
    "RunRecord",
    "RunState",
    "Skip",
    "Task",
    "convert",
    "decode",
    "encode",
    "job_schema",
    "run_id_for",
    "spec_hash",
]
