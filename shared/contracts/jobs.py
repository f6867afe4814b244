"""What a user submits: the job spec, strictly validated."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from shared.contracts.tracking import Tracking

ENTRY_POINT = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
TOKEN = r"^[A-Za-z0-9_-]{1,64}$"
RUN_ID = r"^(?:[A-Za-z0-9_-]{1,64}\.)?[A-Za-z0-9_-]{1,64}$"
"""A run id: `r<hash>`, or `<owner>.r<hash>` for a submitter's run (see `run_id_for`)."""
MAX_SPEC_BYTES = 64 * 1024

Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
Pool = Annotated[str, Meta(pattern=TOKEN, description="Pool of trainers, a subject token.")]
Seconds = Annotated[float, Meta(gt=0, le=30 * 86400)]


class CheckpointPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """When the entry point checkpoints on its own; either, both or neither may be set.

    A final checkpoint is always taken, and the trainer may ask for one at any time
    (preemption), whatever the policy says.
    """

    every_steps: Annotated[int, Meta(ge=1, le=10**9)] | None = 100
    every_seconds: Seconds | None = None
    keep_last: Annotated[int, Meta(ge=1, le=1000)] = 3
    local_every_seconds: Annotated[float, Meta(ge=0, le=30 * 86400)] | None = None
    """Also keep the newest state in the host's memory this often (0: after every step the
    last one is written), so an attempt killed between checkpoints resumes on this host at
    the step it reached (`baton.runtime.local`; docs/operations.md). A run of one rank
    that owns its loop; it costs the host memory one copy of the state."""


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Bounds a run must stay within."""

    max_retries: Annotated[int, Meta(ge=0, le=100)] = 3
    """Failures of user code tolerated before the run is FAILED. Kills, cuts and
    preemptions are the infrastructure's failures and never count."""
    soft_timeout_s: Seconds | None = None
    hard_timeout_s: Seconds | None = None
    stall_timeout_s: Seconds | None = None
    max_cost: Annotated[float, Meta(ge=0, le=1e9)] | None = None


OnFailure = Literal["retry", "fail_fast", "pause"]
"""What a failed attempt of user code leads to (a stall and a divergence guard's stop are
failures too): `retry` while `limits.max_retries` allows, then FAILED; `fail_fast`: FAILED
at once; `pause`: PAUSED, held for a human (`baton resume`). Kills, cuts and preemptions
are the infrastructure's and never count."""


class Guard(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The divergence guard, checked in the training process at every step on the metrics
    the step reports (`baton.runtime.guard`): a non-finite value of any of `metrics`, or —
    when `loss_spike` is set — `loss` above `loss_spike` times its median over the last
    `spike_window` steps, stops the attempt at that step, before any checkpoint of it is
    committed, and `action` follows."""

    non_finite: bool = True
    metrics: tuple[Annotated[str, Meta(max_length=128)], ...] = ("loss", "grad_norm")
    loss_spike: Annotated[float, Meta(gt=1, le=1e6)] | None = None
    spike_window: Annotated[int, Meta(ge=2, le=100_000)] = 100
    action: Literal["stop", "rollback", "pause"] = "stop"
    """`stop`: a failed attempt (the run's `on_failure` decides what follows). `rollback`:
    the run resumes from its last good checkpoint, skipping the data batches of the steps
    since (at most `max_rollbacks` times). `pause`: PAUSED, held for a human."""
    max_rollbacks: Annotated[int, Meta(ge=1, le=1000)] = 3


class Disconnect(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the hub does with a run granted to a site that falls silent (docs/sites.md,
    "Taking back: the disconnect policy"). While the site is silent its trainers go on with
    the run; once it has been silent for `lost_after_s` the hub takes the run back — the
    store refuses the site's copy from then on — and, with `replace`, queues it for any
    trainer of its pool. At heal the site's copy is stopped (a `fenced` event says why) and
    its record is not taken in: the hub's copy is the run."""

    lost_after_s: Annotated[float, Meta(ge=1, le=30 * 86400)] = 600.0
    replace: bool = True
    """False: the hub never hands the run to anyone else; the site keeps it however long
    it is silent."""


class ForkOf(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A forked run's start: run `run_id`'s committed checkpoint at `step` (`baton fork`). The
    fork's first attempt has the checkpointer copy that checkpoint into the fork's own prefix
    (`shared.checkpoint.rebase`), so nothing the parent's retention does can reach it; a
    submitter may fork only its own runs."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    step: Annotated[int, Meta(ge=0, le=10**9)]


RankCount = Annotated[int, Meta(ge=1, le=64)]


class _Counts(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A range of counts, `min` to `max`, named in its errors by the field it is."""

    field: ClassVar[str]
    min: RankCount = 1
    max: RankCount

    def __post_init__(self) -> None:
        if self.min > self.max:
            raise ValueError(f"{self.field}: min ({self.min}) is more than max ({self.max})")


class RankRange(_Counts, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An elastic run's group size: it starts with as many ranks as it can get within the
    range (never fewer than `min`), continues with fewer after losing one when no spare is
    free, and grows back when trainers of its pool are free — each resize at a step
    boundary, from a committed checkpoint, under a new epoch."""

    field: ClassVar[str] = "ranks"


class ReplicaRange(_Counts, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A replicated run's replicas: `max` of them are queued, each its own run placed
    wherever its pool has a trainer; a round is committed at its deadline only if at least
    `min` replicas' changes are in it (docs/diloco.md)."""

    field: ClassVar[str] = "replicas"


class Outer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How a replicated run's replicas meet (docs/diloco.md): DiLoCo — each replica takes
    `inner_steps` steps of its own optimizer, then its change since the last committed
    outer state is averaged with the others' in a round and applied by an outer SGD step
    with (Nesterov) momentum."""

    algorithm: Literal["diloco"] = "diloco"
    inner_steps: Annotated[int, Meta(ge=1, le=10**6)] = 100
    """H: inner steps between two rounds."""
    lr: Annotated[float, Meta(gt=0, le=10)] = 0.7
    momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.5
    """Outer Nesterov momentum. The paper's 0.9 (for LLMs over hundreds of rounds)
    overshoots on the small models measured here, where 0.5 came within 1-3 % of
    synchronous data parallelism (docs/benchmarks.md, "Replicated runs")."""
    nesterov: bool = True
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """What a change is sent in: `bf16`/`fp16` halve the bytes of a round; the outer step
    itself is always taken in fp32."""
    round_deadline_s: Seconds = 60.0
    """How long a replica that has sent its change waits for the others (those still
    training that were in the last round) before it commits the round with the changes
    there (at least `replicas.min` of them)."""
    max_staleness: Annotated[int, Meta(ge=0, le=10**6)] = 4
    """A change made from outer state `b` joins round `k` only if `k - 1 - b` is at most
    this; a staler one is discarded, with a `round` event saying so."""


class JobSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A training job. Its identity is the run id derived from `idempotency_key`."""

    name: Name
    entry_point: Annotated[
        str, Meta(pattern=ENTRY_POINT, max_length=256, description="`module:function`")
    ]
    total_steps: Annotated[int, Meta(ge=1, le=10**9)]
    pool: Pool = "default"
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    config: dict[Annotated[str, Meta(max_length=256)], Any] = {}
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] = 0
    deterministic: bool = False
    idempotency_key: Annotated[str, Meta(pattern=r"^[!-~]{1,128}$")] | None = None
    limits: Limits = Limits()
    ranks: RankCount | RankRange = 1
    """Training processes the run trains on at once, each held by its own trainer of the pool
    (one per GPU): rank 0's trainer leads the group and the run trains only while every rank
    is held. Their code sees `ctx.rank` and `ctx.world_size`, and may wrap its model in
    `DistributedDataParallel`. A range (`{min = 1, max = 4}`) makes the run elastic: its
    checkpoints hold one state that resumes at any size in the range, and
    `ctx.data_parallel()` makes its result the same bits whatever the size was."""
    on_failure: OnFailure | None = None
    """What a failure of its code leads to (`OnFailure`); unset, its pool's policy
    (`BATON_POOLS_FILE`, `[pools.<name>] on_failure`), else `retry`."""
    guard: Guard = Guard()
    collective_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    """How long a collective operation (an all-reduce, the group's start) may wait for a peer
    before it fails. A lost rank is noticed by its trainer's silence within seconds whatever
    this says; this bounds a peer that hangs while its trainer lives."""
    fork: ForkOf | None = None
    """Set on a fork: the run and checkpoint it starts from (`baton fork`)."""
    disconnect: Disconnect | None = None
    """How long the hub waits for a silent site holding this run before it takes the run
    back (`Disconnect`); unset, its pool's (`[pools.<name>.disconnect]`), else 600 s."""
    replicas: RankCount | ReplicaRange = 1
    """Replicas of the model trained at once, each its own run (`<run>-replica-<i>`, of
    `ranks` ranks) placed wherever the pool has trainers, hub or site; they never share a
    collective group and meet only through the store, in the rounds `outer` says. A round
    waits for the replicas still training that were in the last round until its deadline,
    then commits with the changes there: at least one, or `min` of a range
    (`{min = 2, max = 4}`)."""
    outer: Outer = Outer()
    """The outer algorithm of a replicated run (`replicas` above 1); unused otherwise."""
    replica: Annotated[int, Meta(ge=0, le=63)] | None = None
    """Set by the dispatcher on each replica's run (a submission setting it is rejected)."""
    priority: (
        Annotated[int, Meta(ge=-1000, le=1000)]
        | Annotated[str, Meta(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")]
        | None
    ) = None
    """How urgent the run is against the other runs of its pool: a number (higher first),
    or a class its pool names (`[pools.<name>] priorities`, `"high"`); unset, the pool's
    `default_priority`. A queued run that outranks a running one and finds no free trainer
    preempts it — the victim checkpoints first and loses no step. Each owner may submit
    up to its own highest priority (`max_priority`); above it the job is refused."""
    estimate_s: Annotated[float, Meta(gt=0, le=365 * 86400)] | None = None
    """How long the run will train, in seconds, for a pool with a price: what its hold is
    reckoned from until earlier runs of the same name measured their step time
    (docs/scheduling.md, "Credits")."""

    tracking: Tracking | None = None
    """The run's experiment tracker (`[tracking]`, docs/tracking.md): one tracker run for
    the Baton run, which every attempt resumes; what `ctx.report()` records goes there once
    per step, for the steps a committed checkpoint kept."""

    def __post_init__(self) -> None:
        if self.max_replicas > 1 and self.elastic:
            raise ValueError("replicas: a replicated run's ranks must be a number, not a range")
        if self.replica is not None and self.replica >= self.max_replicas:
            raise ValueError(f"replica {self.replica} is not below replicas {self.max_replicas}")

    @property
    def min_ranks(self) -> int:
        return self.ranks.min if isinstance(self.ranks, RankRange) else self.ranks

    @property
    def max_ranks(self) -> int:
        return self.ranks.max if isinstance(self.ranks, RankRange) else self.ranks

    @property
    def min_replicas(self) -> int:
        """The fewest changes a round is committed with at its deadline (1 unless a range
        says more)."""
        return self.replicas.min if isinstance(self.replicas, ReplicaRange) else 1

    @property
    def max_replicas(self) -> int:
        return self.replicas.max if isinstance(self.replicas, ReplicaRange) else self.replicas

    @property
    def replicated(self) -> bool:
        """Whether the run is trained by several replicas meeting in outer rounds."""
        return self.max_replicas > 1

    @property
    def elastic(self) -> bool:
        """Whether the group's size may change while the run lives (`ranks` is a range)."""
        return isinstance(self.ranks, RankRange)


def job_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of `JobSpec`, for clients in any language."""
    schema: dict[str, Any] = msgspec.json.schema(JobSpec)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Baton job spec"
    return schema
