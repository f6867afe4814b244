"""One event type per lifecycle event. Events are published on
`baton.events.<run_id>.<type>` and are the run's history: `baton watch`, `baton logs` and
`baton report` read nothing else."""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec

from shared.contracts.rounds import RoundNote


class _Event(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"
):
    run_id: str
    at: float = msgspec.field(default_factory=time.time)
    """Wall-clock time on the publishing host; for display only, never for decisions."""


class Accepted(_Event, tag="accepted", frozen=True):
    name: str
    pool: str
    total_steps: int
    duplicate: bool = False
    unconfirmed: bool = False
    """Accepted at a site cut off from the hub, which knows the hub's runs only as far as
    its copy of them had caught up when the link went: if the hub ran the same job too, the
    checkpoint store decides at heal which side's run counts (docs/sites.md)."""


class Rejected(_Event, tag="rejected", frozen=True):
    reason: str
    path: str = "$"


class Started(_Event, tag="started", frozen=True):
    worker: str
    token: int
    attempt: int
    start_step: int
    device: str = ""
    """The kind of device the attempt trains on (`cpu`, `cuda`): what its time is priced
    at (`shared.ledger.charges`)."""
    ranks: int = 1
    """Trainers the attempt holds (a group's size): its trainer-seconds per second."""


class Restored(_Event, tag="restored", frozen=True):
    """The attempt's training process loaded its checkpoint (or found none: step 0)."""

    worker: str
    step: int
    damaged: list[int] = []
    restore_s: float = 0.0
    """Seconds the training process spent finding, reading and loading the checkpoint."""
    setup_s: float = 0.0
    """Seconds the entry point's own code took before `restore()` (its imports, building
    the model): the user's part of starting an attempt."""
    resharded_from: int = 0
    """A sharded checkpoint written by this many ranks, loaded at the attempt's size (0:
    not resharded). Resuming is exact; the steps after it are not the bits the old size
    would have made (docs/sharded.md), so the run's self-check is not made across it."""
    read_bytes: int = 0
    """Bytes of shard files the attempt's first rank read to load it."""
    local: bool = False
    """It resumed from its host's local snapshot, ahead of the newest checkpoint: `step`
    was never committed (`baton.runtime.local`)."""


def loss_of(metrics: Mapping[str, float]) -> float | None:
    """The training loss among a job's reported metrics, whatever the framework calls it:
    `loss` (Baton's examples, the Hugging Face Trainer), else a training loss by its usual
    names (`train_loss`, Lightning's `train_loss_step`, `train/loss`), else the one metric
    named `…loss` that is not a validation's; None when there is none."""
    if "loss" in metrics:
        return metrics["loss"]
    for name in ("train_loss", "train_loss_step", "train/loss", "training_loss", "loss_step"):
        if name in metrics:
            return metrics[name]
    held_out = ("val", "eval", "test", "valid")
    losses = [
        k for k in metrics
        if k.lower().endswith("loss") and not k.lower().startswith(held_out)
    ]  # fmt: skip
    return metrics[losses[0]] if len(losses) == 1 else None


class Progress(_Event, tag="progress", frozen=True):
    step: int
    total_steps: int
    metrics: dict[str, float] = {}
    steps_per_s: float = 0.0
    worker: str = ""
    stall_s: float = 0.0
    """Seconds this attempt's training loop has been blocked by checkpoints so far."""
    checkpoint_age_s: float = 0.0
    """Seconds since the state of the newest committed checkpoint (the training a failure
    now would lose), on the trainer's monotonic clock."""
    steps_at_risk: int = 0
    """Steps done since the newest committed checkpoint."""


class CheckpointCommitted(_Event, tag="checkpoint_committed", frozen=True):
    step: int
    token: int
    manifest: str
    bytes: int
    final: bool = False


class CommitRefused(_Event, tag="commit_refused", frozen=True):
    step: int
    token: int
    reason: str


class Diverged(_Event, tag="diverged", frozen=True):
    """This attempt resumed from `checkpoint` and, at `step`, reported `metric` as `got`
    where an earlier attempt reported `expected` (exact `repr()`s): the resume is not exact.
    Training goes on; this tells the user what the checkpoint does not hold."""

    worker: str
    checkpoint: int
    step: int
    metric: str
    expected: str
    got: str


class Completed(_Event, tag="completed", frozen=True):
    step: int
    digest: str
    metrics: dict[str, float] = {}


class Failed(_Event, tag="failed", frozen=True):
    reason: str
    detail: str = ""


class AttemptFailed(_Event, tag="attempt_failed", frozen=True):
    """User code failed; the run is retried if it has retries left."""

    worker: str
    attempt: int
    reason: str
    detail: str = ""
    rank: int | None = None
    """In a group: the rank whose code failed."""
    fault: str = ""
    """Whose failure it was when not the run's code's (counted against its retries all the
    same, never charged: `shared.ledger.charges`): `machine` (a rank's trainer went silent,
    its group breaking a second time from one checkpoint), `hardware` (the process died of
    a hardware fault: `services.trainer.faults`); "" the run's own code."""


class Fenced(_Event, tag="fenced", frozen=True):
    worker: str
    token: int
    reason: str


class Preempted(_Event, tag="preempted", frozen=True):
    worker: str
    step: int
    reason: str = ""
    """Why, when not a preemption notice: an elastic group stopped to grow, or the
    scheduler made room for another run."""
    by: str = ""
    """The run the scheduler made room for (`kind` says by which rule), "" for any other
    preemption (SIGTERM, a drain, growth)."""
    kind: str = ""
    """`priority`, `quota` or `fair_share` for the scheduler's; "" otherwise."""
    to_ranks: int = 0
    """An elastic group shrunk to this many ranks, rather than preempted whole."""


class GroupFormed(_Event, tag="group_formed", frozen=True):
    """Every rank of a group is held: `members` are their workers by rank; `worker` leads
    (rank 0) and `epoch` (its lease token) fences every write of the group."""

    worker: str
    epoch: int
    members: list[str]


class RankLost(_Event, tag="rank_lost", frozen=True):
    """A rank of a group is gone (its trainer died or went silent, or its process was killed):
    every rank stops, and the group forms again from free trainers and resumes from the last
    commit. Not the user's failure: it never counts against `max_retries`."""

    worker: str
    epoch: int
    rank: int
    lost: str
    """The worker that held the rank."""
    reason: str
    step: int = 0


class Resized(_Event, tag="resized", frozen=True):
    """An elastic run's group formed at another size than it last trained at (`from_ranks`
    → `to_ranks`), resuming at `step`, its last commit: `reason` says why — a rank lost
    with no spare free, or trainers free to grow onto. Its result is the same bits
    whatever the size (`ctx.data_parallel()`)."""

    worker: str
    epoch: int
    from_ranks: int
    to_ranks: int
    reason: str
    step: int


class HandedOver(_Event, tag="handed_over", frozen=True):
    """The attempt holding the run (`token`) is dead, and its task was made deliverable at
    once instead of after its AckWait (`shared.state.handover`): its trainer's successor on
    the same host found what it held, or its lease expired (`reason` says which)."""

    worker: str
    token: int
    reason: str


class Redispatched(_Event, tag="redispatched", frozen=True):
    dispatch: int
    reason: str


class Delegated(_Event, tag="delegated", frozen=True):
    """The hub granted the queued run to `site` under grant `epoch`: the site starts, leases
    and completes it there, also while cut off (`shared.state.grants`)."""

    site: str
    epoch: int


class TakenBack(_Event, tag="taken_back", frozen=True):
    """The hub took the run back from `site` (silent past its `lost_after`): the store now
    refuses every token of the site's grant, and the run is queued again under `epoch`."""

    site: str
    epoch: int
    reason: str


class Superseded(_Event, tag="superseded", frozen=True):
    """Two sides ran the run (the same job accepted at the hub and at a cut-off site): the
    store's chain chose `owner` under `epoch` ("" the hub, else a site), and the other
    side's attempt, `loser` under `loser_token`, was stopped; `wasted_steps` it trained
    count for nothing (`shared.state.owner`)."""

    owner: str
    epoch: int
    loser: str
    loser_token: int
    wasted_steps: int


class RunWarning(_Event, tag="warning", frozen=True):
    """Something needs attention but nothing was stopped (yet): `soft_timeout`, `stalled`,
    `budget_<percent>`."""

    kind: str
    detail: str


class Cancelled(_Event, tag="cancelled", frozen=True):
    reason: str


class StallRecovered(_Event, tag="stall_recovered", frozen=True):
    """A run warned of a stall (`warning`, kind `stalled`) stepped again before it was
    stopped: `quiet_s` seconds without a step, then step `step`."""

    worker: str
    step: int
    quiet_s: float


class Guarded(_Event, tag="guarded", frozen=True):
    """The divergence guard stopped the attempt at `step`: `metric` was `value` (its
    `repr()`: exact, and NaN survives JSON), which breaks `rule` (`non_finite`, or
    `loss_spike`). No checkpoint from that step on was committed; `action` is the job's
    policy (`baton.runtime.guard`): `stop` (a failed attempt), `rollback` (resume from the
    last good checkpoint skipping the batches since), or `pause` (held for a human)."""

    worker: str
    step: int
    metric: str
    value: str
    rule: str
    action: str
    good_step: int = 0
    """The last good checkpoint: where a rollback resumes."""


class Paused(_Event, tag="paused", frozen=True):
    """The run is PAUSED for a human (`baton resume` queues it again)."""

    reason: str
    step: int = 0


class Resumed(_Event, tag="resumed", frozen=True):
    """A PAUSED run was queued again."""

    reason: str


class Reopened(_Event, tag="reopened", frozen=True):
    """A FAILED run, settled, was reopened by a rollback to its checkpoint at `step`: its
    life `life` begins here — what it trains from now on is held, metered and settled
    apart from the lives before (`shared.ledger.charges.life_events`)."""

    life: int
    step: int
    reason: str = ""


class RolledBack(_Event, tag="rolled_back", frozen=True):
    """The run went back from its checkpoint at `from_step` to its committed one at `to_step`
    (`baton rollback`): `latest` names that checkpoint under `token`, the attempt that goes
    on from it. The committed checkpoints at `abandoned` left the chain: kept until garbage
    collection, never restored."""

    token: int
    from_step: int
    to_step: int
    abandoned: list[int] = []
    reason: str = ""


class Forked(_Event, tag="forked", frozen=True):
    """The run, a fork (`baton fork`), starts from `parent`'s committed checkpoint at `step`:
    its files were copied into the run's own prefix and committed as its first checkpoint
    (`manifest`, under `token`), with the parent's weights `digest`."""

    token: int
    parent: str
    step: int
    manifest: str
    digest: str = ""


class Round(_Event, tag="round", frozen=True):
    """A replica of a replicated run at an outer round's boundary (docs/diloco.md): its
    change joined a round, was discarded, or waits for a store it cannot reach."""

    worker: str
    note: RoundNote


Event = (
    Accepted
    | Rejected
    | Started
    | Restored
    | Progress
    | CheckpointCommitted
    | CommitRefused
    | Diverged
    | Completed
    | Failed
    | AttemptFailed
    | Fenced
    | Preempted
    | HandedOver
    | GroupFormed
    | RankLost
    | Resized
    | Redispatched
    | Delegated
    | TakenBack
    | Superseded
    | RunWarning
    | Cancelled
    | StallRecovered
    | Guarded
    | Paused
    | Resumed
    | Reopened
    | RolledBack
    | Forked
    | Round
)


def kind_of(event: Event) -> str:
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag
