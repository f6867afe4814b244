"""The commit protocol's messages and the objects it writes to storage."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID

GROUP = r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$"
"""A registered name, as a checkpoint's files are named after it (`shared.checkpoint.files`)."""

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]
FileName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")]


class FileRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: FileName
    """Name inside the checkpoint (`model.safetensors`); never a path."""
    key: str
    """Immutable object key, `runs/<run>/data/<token>/<step>/<name>`."""
    size: Annotated[int, Meta(ge=0)]
    sha256: Sha256


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A committed checkpoint that a `CommitRequest` makes the run's latest instead of new
    files (`shared.checkpoint.rebase`): the run's own (a rollback: `latest` is rewound to
    it, and the checkpoints after it are abandoned) or another run's (a fork's first
    checkpoint: its files are copied into the run's own prefix first)."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    step: Annotated[int, Meta(ge=0)]
    spec_hash: Annotated[str, Meta(pattern=r"^([0-9a-f]{16})?$")] = ""
    """A fork's: the hash of its own job spec, written into the copied meta.json files (a
    checkpoint is restored only by the run and spec its meta.json names)."""
    reason: Annotated[str, Meta(max_length=512)] = ""


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
    sharded: list[Annotated[str, Meta(pattern=GROUP)]] = []
    """Registered names whose tensors every rank holds a part of (an FSDP2 model, its
    optimizer): each rank's file of each must be there, and their chunks must tile every
    tensor (`shared.checkpoint.shards`)."""
    base: Base | None = None
    """Set for a rollback or a fork's graft: `step` is `base.step`, `files` is empty, and
    the checkpoint committed is `base`'s (`shared.checkpoint.rebase`)."""
    side: str | None = None
    """Whose attempt asks: "" the hub's, else the site's the run is granted to. A site's
    trainer may train a hub task (its site's checkpointer commits it): the chain stays the
    hub's (`Pointer.site`, `shared.state.owner`). None: the committing checkpointer's side."""


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
    sharded: list[str] = []
    """Registered names saved as every rank's chunks (`CommitRequest.sharded`): a checkpoint
    with any resumes at another group size, each rank reading the chunks it now owns."""
    grafted_from: str | None = None
    """A fork's first checkpoint: the parent's manifest its files were copied from."""


class Pointer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The run's `latest`. Ordered by (token, step): a higher token always wins, the same
    token needs a higher step — until a final checkpoint is named, or the run's end is
    sealed (`ended`), after which nothing moves it (`shared.checkpoint.commit`). A
    `manifest` of "" is a fence that no checkpoint follows yet (step 0): a run taken back
    from a site before any checkpoint of it was committed, whose old grant's tokens are
    refused from then on (`shared.state.grants.fence`), or cancelled before any."""

    run_id: str
    token: int
    step: int
    manifest: str
    final: bool = False
    site: str = ""
    """The side whose authority wrote it ("" the hub, else a site's name): with the token's
    epoch, who owns the run's chain (`shared.state.owner`)."""
    ended: str = ""
    """The run ended without its final checkpoint ("cancelled"), sealed by the side that
    ended it (`shared.checkpoint.commit.seal`): like a final one, nothing follows it."""

    def supersedes(self, other: Pointer) -> bool:
        return (self.token, self.step) > (other.token, other.step)

    @property
    def epoch(self) -> int:
        """The grant epoch of its token (`shared.state.grants.token_of`)."""
        return self.token >> 32

    @property
    def checkpoint(self) -> str | None:
        """The manifest of the checkpoint `latest` names; None for a fence alone."""
        return self.manifest or None


class Rewound(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a rollback did, written once before it moved `latest`
    (`runs/<run>/rewinds/<token>-<from_token>-<from_step>.json`): `latest` went from
    (`from_token`, `from_step`) to the checkpoint at `to_step` (`manifest`) under `token`,
    and the committed checkpoints in `abandoned` (manifest keys, newest first) left the
    chain. A note whose rewind lost its race is harmless: a checkpoint counts as abandoned
    only while it is off the chain (`shared.checkpoint.lineage`)."""

    run_id: str
    token: int
    from_token: int
    from_step: int
    to_step: int
    manifest: str
    abandoned: list[str]
    reason: str = ""
    created_at: float


class StoreInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the hub's checkpoint store is, as its checkpointer says on start (KV
    `baton_hub`, key `store`): what a client that has only NATS credentials reads to find
    it (`baton pull`, `checkpoints`, `ui`, `rounds --replay`). Never a secret: the store's
    own credentials stay with whoever may read it."""

    url: str
    """`file:///abs/dir` or `s3://bucket/prefix`."""
    s3_endpoint: str = ""
    """An S3 store's endpoint, when not AWS's own (`BATON_S3_ENDPOINT`)."""
