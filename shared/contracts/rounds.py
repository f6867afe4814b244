"""A replicated run's round log in the store (`shared.checkpoint.rounds`): the changes the
replicas send and the manifests that commit each outer round."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.contracts.checkpoints import Sha256
from shared.contracts.jobs import RUN_ID

Index = Annotated[int, Meta(ge=0)]


class Change(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One replica's change of the weights: the outer state of round `base` minus its weights
    after its inner steps, stored once under its attempt's token (`changes_key`)."""

    replica: Index
    base: Index
    """The committed round (0: the start) whose outer state the inner steps began from."""
    step: Index
    """The replica's inner step the change was taken at."""
    token: Index
    """The fencing token of the replica's attempt that took it."""
    key: str
    size: Index
    sha256: Sha256
    precision: Literal["fp32", "bf16", "fp16"]


class Mean(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The mean of a round's changes, as its closer stored it (`rounds.mean_of`)."""

    key: str
    size: Index
    sha256: Sha256
    precision: Literal["fp32", "bf16", "fp16"]


class RoundManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Round `round`, committed once (a write-once object): the outer state of round
    `round - 1` stepped with `mean`, the mean of exactly `changes`, summed in replica order.
    Its result is `outer_step`'s pure function of these, so replaying the log gives the
    same bits (`shared.checkpoint.rounds.replay`)."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    round: Annotated[int, Meta(ge=1)]
    changes: list[Change]
    mean: Mean
    """Their mean, what every replica applies."""
    result: Sha256
    """`weights_digest` of the outer weights after the round: every replica checks its own
    step against it."""
    closed_by: Index
    """The replica whose attempt committed the round."""
    token: Index
    """That attempt's fencing token."""
    stragglers: list[Index]
    """Replicas still training whose change it did not take."""
    deadline: bool
    """Committed at the deadline, without a change it waited for."""
    waited_s: Annotated[float, Meta(ge=0)]
    """How long the closer waited for the others."""
    closed_at: float
    """Wall time (informational: never compared across machines)."""


class ReplicaDone(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A replica that finished its steps: no round waits for it any more."""

    replica: Index
    step: Index
    round: Index
    """The round its weights ended at."""


RoundOutcome = Literal["waiting", "joined", "discarded", "skipped"]
"""What became of a replica's change at a round boundary: `waiting` for the round (sent
when the wait begins), `joined` the round named, `discarded` (staler than
`max_staleness` allows), or `skipped` (the store could not be reached: the replica trains
on from the outer state it has, and sends its change, covering these steps too, later)."""


class RoundNote(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A replica's account of one round boundary: sent by its training process to its
    trainer, and published by it in a `round` event."""

    outcome: RoundOutcome
    replica: Index
    step: Index
    base: Index
    """The round its change was made from."""
    round: Index
    """`joined`: the round its change went into; otherwise the newest committed round."""
    replicas: list[Index] = []
    """`joined`: the replicas whose changes the round took."""
    stragglers: list[Index] = []
    """`joined`: replicas still training whose changes the round did not wait for."""
    closed_by: int = -1
    deadline: bool = False
    waited_s: Annotated[float, Meta(ge=0)] = 0.0
    """Time the replica's steps stood still for the round."""
    sent_bytes: Index = 0
    received_bytes: Index = 0
    detail: Annotated[str, Meta(max_length=512)] = ""
