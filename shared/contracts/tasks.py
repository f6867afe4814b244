"""The dispatched unit of work a trainer pulls from its pool."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from shared.contracts.jobs import RUN_ID, JobSpec
from shared.contracts.records import RunRecord


class Task(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`dispatch` counts how often the run was put on the queue; with the run id it forms
    the task's `Nats-Msg-Id`, so a dispatch repeated by a retry is stored only once."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    spec: JobSpec
    dispatch: Annotated[int, Meta(ge=1)] = 1
    lease_key: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")] | None = None
    """The run's key in the leases bucket, when the hub keys leases by a secret
    (`shared.state.lease.lease_key`): only a trainer handed this task can name — and so write —
    the run's lease. None: the run id is the key."""
    grant: RunRecord | None = None
    """Set on a task delegated to a site (`shared.state.grants`): the run's record as the hub
    granted it (its `site` and `epoch`), from which the site keeps the run's record itself."""


class Claim(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a trainer holds while an attempt runs, kept in its work directory for the next
    process under its worker identity (`services/trainer/claim.py`)."""

    run_id: Annotated[str, Meta(pattern=RUN_ID)]
    lease_key: str
    token: int
    """The lease's fencing token when the attempt took it; the run record keeps the task
    delivery that the attempt holding it answers (`shared.state.handover`)."""
    site: str = ""
    """The site whose own bucket holds the lease and the record (a run granted to it),
    "" for the hub's."""
