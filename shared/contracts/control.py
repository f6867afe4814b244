"""Requests that steer runs: cancel (a user's), steering (an operator's: roll back, pause,
resume, checkpoint now), and commands to a trainer (the reaper's and the dispatcher's)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID


class CancelRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    reason: Annotated[str, Meta(max_length=512)] = "cancelled by user"


class _Steer(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="action"
):
    """Published on `baton.steer.<run_id>` (the subject must name the same run: it is what
    the servers let a submitter publish on) and carried out by the dispatcher
    (`services/dispatcher/steering.py`), which changes the run record — the order itself —
    and wakes the run's trainer. A request that cannot apply to the run as it stands is
    dead-lettered with its reason and changes nothing."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    reason: Annotated[str, Meta(max_length=512)] = ""

    @property
    def action(self) -> str:
        tag = type(self).__struct_config__.tag
        assert isinstance(tag, str)
        return tag


class Rollback(_Steer, tag="rollback", frozen=True):
    """Continue the run from its committed checkpoint at `step`, under a new attempt; the
    checkpoints after it are abandoned (kept until retention, never restored)."""

    step: Annotated[int, Meta(ge=0)]


class Pause(_Steer, tag="pause", frozen=True):
    """Stop the run at its next checkpoint and hold it, PAUSED, until resumed."""


class Resume(_Steer, tag="resume", frozen=True):
    """Queue a PAUSED run again: it resumes from its newest committed checkpoint; with
    `allow_changes`, also under other software than that checkpoint recorded."""

    allow_changes: bool = False


class TakeCheckpoint(_Steer, tag="checkpoint", frozen=True):
    """Write a checkpoint now, beside the job's own cadence."""


Steer = Rollback | Pause | Resume | TakeCheckpoint


class Command(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sent on core NATS to `baton.control.<worker>`. `wake`: look at the run record now
    (it changed: an order, such as a checkpoint asked), and at the worker's drain key
    (`run_id` "" when only that changed). `kill`: the worker runs `run_id` without holding
    its lease — an orphan — so its training process must die. Losing either costs only
    latency: the record, the lease and the drain key stay the truth, the trainer reads its
    record at every renewal, and the sweeps repeat."""

    run_id: str
    action: Literal["wake", "kill"]
    reason: str = ""


class Pulse(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sent on core NATS to `baton.pulse.<worker>` every `BATON_PULSE` seconds by a hub
    trainer while it holds `run_id`'s lease at `token`: that it is alive. Nothing stores
    it; the reaper hands the run over when it stops (`services/reaper/silences.py`)."""

    worker: str
    run_id: str
    token: int


class ClientInfo(msgspec.Struct, frozen=True):
    """The fields of a server advisory's `client` that Baton uses."""

    name: str = ""
    """The connection's name (a trainer's is `baton-trainer-<worker>`)."""
    user: str = ""


class Disconnected(msgspec.Struct, frozen=True):
    """The fields of nats-server's `io.nats.server.advisory.v1.client_disconnect` that Baton
    uses (`services/reaper/departures.py`; the server's advisory has more, ignored)."""

    client: ClientInfo
    reason: str = ""
    """Why the server closed it: "Client Closed" (the socket ended), "Read Error",
    "Server Shutdown", "Stale Connection", "Slow Consumer (…)", "Kicked"…"""


class WorkerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A trainer's heartbeat in the `baton_workers` bucket (expires by server TTL)."""

    worker: str
    pool: str
    host: str
    pid: int
    device: str
    """`cpu`, or `cuda:<index>`: the GPU (nvidia-smi's index on the host) its training
    processes use."""
    gpu_name: str = ""
    gpu_memory_bytes: int = 0
    run_id: str | None = None
    token: int | None = None
    step: int | None = None
    site: str = ""
    """The site the trainer runs at; empty at the hub."""
    rank: int | None = None
    """The rank it holds of a run of several ranks (`token` is then the group's epoch)."""
    drained: bool = False
    """Taken out of its pool (`baton drain`): it takes no task or rank, and what it runs
    hands over at its next checkpoint."""
    at: float


class Drain(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A trainer taken out of its pool: its key in `baton_drains` (`names.drain_key`), there
    from `baton drain` until `baton undrain`. The key is the order itself — the trainer reads
    it at start, before every heartbeat and on a wake — so it outlives the trainer's
    restarts and any lost message."""

    worker: Annotated[str, Meta(max_length=256)]
    reason: Annotated[str, Meta(max_length=512)] = ""
    at: float
    """The writer's wall clock: shown, never compared."""
