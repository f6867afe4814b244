"""A run as the services would leave it, written straight into a real nats-server's
bucket and stream: what the Python API's tests read back without a stack."""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client

from shared.bus import streams
from shared.bus.emit import emit
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import Completed, Progress, Started
from shared.state.runs import Runs

RUN = "r0123456789abcdef0001"
SPEC = JobSpec(name="py", entry_point="m:f", total_steps=10)


async def running(nc: Client, run_id: str = RUN) -> Runs:
    """Baton's streams declared, and `run_id` RUNNING at step 4 with its events so far."""
    js = nc.jetstream()
    await streams.ensure(js)
    runs = await Runs.open(js)
    now = time.time()
    record = RunRecord(
        run_id=run_id, spec=SPEC, spec_hash="h", state=RunState.RUNNING, created_at=now,
        updated_at=now, attempts=1, worker="w1", token=1,
    )  # fmt: skip
    assert await runs.create(record)
    await emit(js, Started(run_id=run_id, worker="w1", token=1, attempt=1, start_step=0))
    await emit(js, Progress(run_id=run_id, step=4, total_steps=10, metrics={"loss": 0.5}))
    return runs


async def complete(nc: Client, runs: Runs, run_id: str = RUN, event: bool = True) -> None:
    """The run COMPLETED, as its trainer ends it: the record first, then (unless not
    `event`: its writer died in between) the event."""

    def done(r: RunRecord) -> RunRecord | None:
        return msgspec.structs.replace(r, state=RunState.COMPLETED, step=10, digest="d")

    assert await runs.update(run_id, done) is not None
    if event:
        await emit(nc.jetstream(), Completed(run_id=run_id, step=10, digest="d"))
