"""The run record: the truth about a run. Queues only trigger work; this decides it."""

from __future__ import annotations

import enum
import hashlib
from typing import Literal

import msgspec

from shared.contracts.codec import encode
from shared.contracts.jobs import Guard, JobSpec, OnFailure, Outer


class RunState(enum.StrEnum):
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    """Held for a human: by an operator (`baton pause`) or by the job's policy on a failure
    or a divergence. Nothing trains it and no task is queued until `baton resume`."""
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


class Skip(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Data a rolled-back run leaves out (`guard.action = "rollback"`): an attempt that
    resumes from the checkpoint at step `after` has every `ctx.data_loader()` discard
    `batches` batches first — those of the steps between that checkpoint and the one that
    blew up — and then trains on."""

    after: int
    batches: int


class Preemption(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The scheduler's order to the attempt holding a run: make room for run `by`. The
    attempt checkpoints, stops, and the run is QUEUED again (`to_ranks` 0), or an elastic
    group re-forms with `to_ranks` ranks; either way no step is lost (`shared.scheduling`)."""

    by: str
    kind: Literal["priority", "quota", "fair_share"]
    reason: str
    to_ranks: int = 0


class Stall(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The hang that stopped the run's last stalled attempt (`services/trainer/stall.py`):
    the step it hung after, and the run's step time as that attempt had measured it. The
    next attempt bounds its steps by that step time from the moment it has restored,
    rather than as a new run's, and a hang after the same step again is not retried."""

    step: int
    step_s: float | None = None


class Rewind(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One rollback in a run's lineage (`baton rollback`): under the attempt of `token` the
    run went back from its checkpoint at `from_step` to the one at `to_step`; the committed
    checkpoints at `abandoned` left its chain (kept until garbage collection, never
    restored)."""

    token: int
    from_step: int
    to_step: int
    abandoned: list[int] = []
    reason: str = ""


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
    pause_requested: str | None = None
    """Set while a RUNNING run is asked to pause; its trainer checkpoints and stops, and the
    run is PAUSED (this says why while it is)."""
    rollback_to: int | None = None
    """Set while the run is ordered back to its committed checkpoint at this step (`baton
    rollback`): the attempt running stops without a checkpoint, and the next one rewinds
    `latest` to it before it starts (`services/trainer/rewind.py`), then clears this."""
    rollback_reason: str | None = None
    rewinds: list[Rewind] = []
    """The rollbacks done, oldest first (the last `MAX_REWINDS`)."""
    stop_token: int | None = None
    stop_reason: str | None = None
    """No longer written: a stall is noticed and stopped by the attempt's own trainer
    (`services/trainer/stall.py`). Kept, and cleared by a failure, so that records written
    before still decode."""
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
    on_failure: OnFailure = "retry"
    """The failure policy in force: the job's, else its pool's, decided once by the
    dispatcher as it creates the record."""
    skips: list[Skip] = []
    """The data the divergence guard's rollbacks left out, one per rollback (the number of
    rollbacks so far)."""
    group_size: int = 0
    """How many ranks the run trained with last (0 before its first attempt): an elastic
    run's group that forms at another size has been resized."""
    site: str = ""
    """The site holding the run's grant ("" = the hub): it starts, leases, checkpoints and
    completes the run there, also while cut off, and reports back (`shared.state.grants`)."""
    epoch: int = 0
    """The run's grant epoch, moved on by every grant and every taking back: each fencing
    token issued for the run, by the hub or a site, is `epoch << 32 | revision`
    (`shared.state.grants.token_of`), so the store orders every authority's tokens."""
    priority: int = 0
    """The run's priority in its pool, resolved once by the dispatcher from the job's
    `priority` (a number, or a class its pool names) and the pool's default."""
    admitted: bool = True
    """False while a QUEUED run waits for the scheduler, with no task in any work queue: the
    scheduler admits it — publishes its task, or grants it to a site — when its pool has
    room for it (`shared.scheduling`). Records written before the scheduler read as
    admitted: their task was published at submit."""
    preempt: Preemption | None = None
    """Set while the attempt holding the run is asked to make room for another run."""
    ranks_cap: int | None = None
    """The most ranks the scheduler lets an elastic run hold now (None: its `max`)."""
    preemptions: int = 0
    """Times the scheduler took the run off its trainers for another."""
    stall: Stall | None = None
    """The hang that stopped its last stalled attempt, if one did."""
    broke_at: int | None = None
    """The newest committed checkpoint when the run's group last broke (a rank lost, or one
    that hung until its peers' collective timed out): a break again before any checkpoint
    past it is taken for a hang in the run's code, and counted as a failure."""
    changes_allowed: bool = False
    """Its operator let it resume under other software than its checkpoints recorded
    (`baton resume --allow-changes`; `baton.runtime.compat`): a deterministic run is
    otherwise PAUSED rather than resumed inexactly."""
    changed: list[str] = []
    """What differed from the software its checkpoint recorded when it last resumed (torch,
    Python or Baton versions, its entry point's code); empty when nothing did."""
    checkpoints_asked: int = 0
    """Checkpoints operators asked for (`baton checkpoint`) so far: the attempt holding the
    run has its training process write one for each it has not served yet. In the record,
    like every order, so a lost wake costs latency, never the checkpoint."""
    price: dict[str, float] = {}
    """Credits per trainer-second by device kind, its pool's when the run was accepted;
    empty: the run costs no credits. Its holds were reckoned at it, and it is charged at
    it (`shared.ledger`)."""
    holds: list[int] = []
    """The credits held for the run's life (`life`), in units
    (`shared.contracts.pools.units`), one per hold: at submit (or its reopening), and at
    each resume its holds did not cover."""
    metered_s: float = 0.0
    """Trainer-seconds its ended attempts trained (a failure of its own code: the whole
    attempt), as their trainers measured them: the running attempt's meter adds its own
    to this, against the holds, and pauses the run when they are spent. The settlement
    charges what the run's events say (`shared.ledger.charges`)."""
    committed_s: float = 0.0
    """Trainer-seconds the attempt named by `token` trained up to its newest committed
    checkpoint (booked by each commit, `transitions.advance_step`), not in `metered_s`
    yet: its verdict books the whole attempt instead, and an attempt that died without one
    (its host lost, its lease taken over) is booked this much when the next one starts
    (`transitions.mark_running`) — the steps it kept, which are what it is charged."""
    settled: bool = False
    """The life's holds are settled in the ledger (charged, the rest refunded), once."""
    life: int = 0
    """How often a settled run was reopened (`baton rollback` of a FAILED run): each life
    holds, is metered and is settled on its own (`hold.<run>.l<life>.<n>`,
    `settle.<run>.l<life>`; life 0's are `hold.<run>.<n>` and `settle.<run>`)."""
    metered_before: float = 0.0
    """`metered_s` when this life began: the life's own trainer-seconds are the rest."""
    trace: dict[str, str] = {}
    """The submission's trace context (W3C headers; empty when untraced): every task the
    scheduler publishes for the run carries it, so a run is one trace however often it is
    admitted."""

    @property
    def owner(self) -> str:
        return run_owner(self.run_id)

    @property
    def held(self) -> int:
        """Units held for the run's life so far."""
        return sum(self.holds)

    @property
    def life_metered_s(self) -> float:
        """Trainer-seconds its attempts trained in this life: the ended ones', and the
        committed part of one that died without a verdict."""
        return max(0.0, self.metered_s + self.committed_s - self.metered_before)


def run_owner(run_id: str) -> str:
    """The owner a run id names (`<owner>.r…`), "" for an operator's run (`run_id_for`)."""
    owner, dot, _ = run_id.partition(".")
    return owner if dot else ""


MAX_REWINDS = 20
"""Rollbacks a run record remembers; each is also a `rolled_back` event."""


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


REPLICA_MARK = "-replica-"


def replica_run_id(run_id: str, replica: int) -> str:
    """The run of replica `replica` of the replicated run `run_id` (`JobSpec.replicas`)."""
    return f"{run_id}{REPLICA_MARK}{replica}"


def replica_of(run_id: str) -> tuple[str, int] | None:
    """The replicated run and replica index a replica's run id names; None for any other
    run (run ids made from keys never hold the mark: `run_id_for`)."""
    parent, mark, index = run_id.rpartition(REPLICA_MARK)
    return (parent, int(index)) if mark and parent and index.isdigit() else None


_ADDED_LATER: dict[str, object] = {
    "ranks": 1,
    "collective_timeout_s": 60.0,
    "on_failure": None,
    "guard": msgspec.to_builtins(Guard()),
    "fork": None,
    "disconnect": None,
    "replicas": 1,
    "outer": msgspec.to_builtins(Outer()),
    "replica": None,
    "priority": None,
    "estimate_s": None,
    "tracking": None,
}
"""Spec fields added after checkpoints were first written, with their defaults: left out of
the hash while at their default, so a run's checkpoints keep matching its spec across
versions."""


def spec_hash(spec: JobSpec) -> str:
    fields = msgspec.to_builtins(msgspec.structs.replace(spec, idempotency_key=None))
    # Where a run keeps its state between checkpoints says nothing of what it trains.
    fields["checkpoint"].pop("local_every_seconds", None)
    for name, default in _ADDED_LATER.items():
        if fields.get(name) == default:
            del fields[name]
    return hashlib.sha256(encode(fields)).hexdigest()[:16]
