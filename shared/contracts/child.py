"""The protocol between a trainer and its training child process.

JSON lines over two private pipes (not stdin/stdout, which belong to user code and are
captured as the run's log)."""

from __future__ import annotations

import msgspec

from shared.contracts.checkpoints import FileRef
from shared.contracts.tasks import Task

EXIT_BAD_LAUNCH = 2
"""The child's exit status when the run's entry point cannot be loaded; the trainer then
fails the run without retrying it."""


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


# parent -> child


class Launch(_Msg, tag="launch", frozen=True):
    task: Task
    token: int
    worker: str
    store_url: str


class Control(_Msg, tag="control", frozen=True):
    """`checkpoint`: write one now. `stop`: checkpoint and return. `token`: the lease was
    re-acquired under a new fencing token; use it for the next files."""

    action: str
    token: int = 0


# child -> parent


class Loaded(_Msg, tag="loaded", frozen=True):
    """Where the attempt really starts: the newest checkpoint that verified, after skipping
    the `damaged` ones (steps whose files no longer match their manifest)."""

    step: int
    damaged: list[int] = []
    took_s: float = 0.0
    """Seconds spent finding, reading and loading it (0 for a fresh start)."""
    setup_s: float = 0.0
    """Seconds the entry point took before it called `restore()`: importing its module and
    its own set-up (building the model, opening data)."""


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


class Divergence(_Msg, tag="divergence", frozen=True):
    """A resumed attempt's step reported a metric that differs, bit for bit, from what an
    earlier attempt reported at the same step after the same checkpoint (`baton.runtime.witness`).
    Values are `repr()`s of the floats: exact, and NaN survives JSON."""

    checkpoint: int
    step: int
    metric: str
    expected: str
    got: str


class Finished(_Msg, tag="finished", frozen=True):
    step: int
    stopped: bool
    """True when the run stopped early because the trainer asked it to."""


ToChild = Launch | Control
FromChild = Loaded | StepDone | CheckpointReady | Divergence | Finished
