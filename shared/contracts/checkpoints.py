"""The commit protocol's messages and the objects it writes to storage."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
FileName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]


class FileRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: FileName
    """Name inside the checkpoint (`model.safetensors`); never a path."""
    key: str
    """Immutable object key, `runs/<run>/data/<token>/<step>/<name>`."""
    size: Annotated[int, Meta(ge=0)]
    sha256: Sha256


class CommitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    token: Annotated[int, Meta(ge=1)]
    step: Annotated[int, Meta(ge=0)]
    worker: str
    files: list[FileRef]
    final: bool = False
    metrics: dict[str, float] = {}
    digest: str = ""
    """sha256 over the model tensors in name order (see `shared.checkpoint.digest`)."""
    keep_last: Annotated[int, Meta(ge=1)] = 3
    """The job's retention: committed checkpoints to keep besides pinned and final ones."""
    ranks: Annotated[int, Meta(ge=1, le=64)] = 1
    """Ranks whose shards the checkpoint must hold: one that lacks any rank's cannot be
    committed (`shared.checkpoint.commit`)."""


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Written once per checkpoint; a checkpoint exists once `latest` points at it."""

    run_id: str
    token: int
    step: int
    worker: str
    files: list[FileRef]
    final: bool
    metrics: dict[str, float]
    digest: str
    previous: str | None
    """Manifest key `latest` named when this one was committed: the walk-back chain used
    when a checkpoint fails verification on restore."""
    created_at: float
    ranks: int = 1
    """The group size the checkpoint was written at; every rank's files are listed."""


class Pointer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The run's `latest`. Ordered by (token, step): a higher token always wins, the same
    token needs a higher step."""

    run_id: str
    token: int
    step: int
    manifest: str
    final: bool = False

    def supersedes(self, other: Pointer) -> bool:
        return (self.token, self.step) > (other.token, other.step)
