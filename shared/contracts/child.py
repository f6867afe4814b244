"""The protocol between a trainer and its training child process.

JSON lines over two private pipes (not stdin/stdout, which belong to user code and are
captured as the run's log)."""

from __future__ import annotations

import msgspec

from shared.contracts.checkpoints import FileRef
from shared.contracts.records import Skip
from shared.contracts.rounds import RoundNote
from shared.contracts.tasks import Task

EXIT_BAD_LAUNCH = 2
"""The child's exit status when the run's entry point cannot be loaded; the trainer then
fails the run without retrying it."""
EXIT_USER_ERROR = 1
"""The child's exit status when the user's code raised (its traceback is in the output)."""
EXIT_GROUP_BROKEN = 3
"""The child's exit status when its group broke under it: a collective failed because a peer
was gone or too slow (torch.distributed's error, not the user's). Not a user failure."""
EXIT_GUARDED = 4
"""The child's exit status when the divergence guard stopped it (after `Tripped`): nothing
from that step on was written. The job's `guard.action` decides what follows."""
EXIT_CHANGED = 5
"""The child's exit status when a deterministic run would resume under other software than
its checkpoint recorded (`baton.runtime.compat`), not allowed: the run is PAUSED."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


# parent -> child


class Rendezvous(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where a rank of a group finds its peers. Rank 0's process serves torch.distributed's
    store (on `addr`, any free port: it reports the port in `Listening`); the others connect
    to `addr:port`. Every key in that store is prefixed by the epoch, so a process of an
    older group can never take part in a newer one."""

    epoch: int
    """The group's epoch: the leader's lease token, carried by every write of every rank."""
    rank: int
    world_size: int
    local_rank: int = 0
    """This rank's index among the group's ranks on the same host."""
    addr: str
    port: int = 0
    """Rank 0's store; 0 for rank 0 itself, which picks one."""
    timeout_s: float = 60.0
    """The job's `collective_timeout_s`."""


class Launch(_Msg, tag="launch", frozen=True):
    task: Task
    token: int
    worker: str
    store_url: str
    group: Rendezvous | None = None
    """Set for a run of several ranks."""
    skips: list[Skip] = []
    """The run's rolled-back data (`RunRecord.skips`)."""
    allow_changes: bool = False
    """The operator allowed a deterministic run to resume under other software than its
    checkpoint recorded (`RunRecord.changes_allowed`)."""


class Control(_Msg, tag="control", frozen=True):
    """`checkpoint`: write one now. `stop`: checkpoint and return. `token`: the lease was
    re-acquired under a new fencing token; use it for the next files. `committed`: the
    attempt's checkpoint at `step` is committed (the steps before it are kept)."""

    action: str
    token: int = 0
    step: int = 0


# child -> parent


class Loaded(_Msg, tag="loaded", frozen=True):
    """Where the attempt really starts: the newest checkpoint that verified, after skipping
    the `damaged` ones (steps whose files no longer match their manifest)."""

    step: int
    damaged: list[int] = []
    took_s: float = 0.0
    """Seconds spent finding, reading and loading it (0 for a fresh start)."""
    changed: list[str] = []
    """What differs from the software its checkpoint recorded (`baton.runtime.compat`)."""
    setup_s: float = 0.0
    """Seconds the entry point took before it called `restore()`: importing its module and
    its own set-up (building the model, opening data)."""
    resharded_from: int = 0
    """The group size a sharded checkpoint was written at, when it was loaded at another
    (`baton.runtime.shards`); 0 when it was not resharded. What follows is exact at the new
    size but not the bits the old size would have made (docs/sharded.md)."""
    read_bytes: int = 0
    """Bytes this rank read of other ranks' shard files: the chunks it owns now."""
    local: bool = False
    """It resumed from this host's local snapshot, ahead of the newest checkpoint
    (`baton.runtime.local`)."""


class StepDone(_Msg, tag="step", frozen=True):
    step: int
    metrics: dict[str, float] = {}


class CheckpointReady(_Msg, tag="checkpoint", frozen=True):
    step: int
    token: int
    files: list[FileRef]
    final: bool
    digest: str
    metrics: dict[str, float] = {}
    stall_s: float = 0.0
    """How long the training loop was blocked for this checkpoint."""
    ranks: int = 1
    """How many ranks wrote it: their files are all in `files`."""
    sharded: list[str] = []
    """Registered names saved as every rank's chunks (`shared.checkpoint.shards`)."""


class Divergence(_Msg, tag="divergence", frozen=True):
    """A resumed attempt's step reported a metric that differs, bit for bit, from what an
    earlier attempt reported at the same step after the same checkpoint (`baton.runtime.witness`).
    Values are `repr()`s of the floats: exact, and NaN survives JSON."""

    checkpoint: int
    step: int
    metric: str
    expected: str
    got: str


class Tripped(_Msg, tag="tripped", frozen=True):
    """The divergence guard stopped the attempt at `step` (`baton.runtime.guard`): `metric`
    was `value` (a `repr()`), breaking `rule` (`non_finite` or `loss_spike`)."""

    step: int
    metric: str
    value: str
    rule: str
    detail: str = ""


class Listening(_Msg, tag="listening", frozen=True):
    """Rank 0's process serves its group's store on `port`; the other ranks may start."""

    port: int


class RoundReached(_Msg, tag="round", frozen=True):
    """A replica's round boundary (`baton.runtime.replica`): what became of its change."""

    note: RoundNote


class Finished(_Msg, tag="finished", frozen=True):
    step: int
    stopped: bool
    """True when the run stopped early because the trainer asked it to."""


ToChild = Launch | Control


FromChild = (
    Loaded | StepDone | CheckpointReady | Divergence | Tripped | Listening | Finished | RoundReached
)
