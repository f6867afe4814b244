"""`baton watch` ends on the run record when the event it waits for never comes: the writer
of a terminal outcome died between the record's compare-and-swap and the event (injected
here by writing the record and no event). A real nats-server; no stack."""

from __future__ import annotations

import asyncio
import io
import time

import msgspec
import pytest
from rich.console import Console

from baton.cli import watch
from baton.stack.natsserver import NatsServer
from shared.bus import streams
from shared.bus.connect import connect
from shared.bus.emit import emit
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import Completed, Progress, Started
from shared.state.runs import Runs

RUN = "r0123456789abcdef0000"


async def test_watch_ends_on_a_terminal_record_whose_event_never_came(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watch, "QUIET_S", 0.2)
    nc = await connect(nats_server.url, "test", first_attempt_timeout=5)
    try:
        js = nc.jetstream()
        await streams.ensure(js)
        runs = await Runs.open(js)
        now = time.time()
        spec = JobSpec(name="w", entry_point="m:f", total_steps=10)
        running = RunRecord(
            run_id=RUN, spec=spec, spec_hash="h", state=RunState.RUNNING, created_at=now,
            updated_at=now, attempts=1, worker="w1", token=1,
        )  # fmt: skip
        assert await runs.create(running)
        await emit(js, Started(run_id=RUN, worker="w1", token=1, attempt=1, start_step=0))
        await emit(js, Progress(run_id=RUN, step=4, total_steps=10, metrics={"loss": 0.5}))

        out = io.StringIO()
        watching = asyncio.create_task(watch.watch_run(nc, RUN, Console(file=out), False))
        # Quiet spells on a RUNNING record do not end the watch.
        await asyncio.sleep(0.6)
        assert not watching.done(), "watch ended while the run was still running"

        def complete(r: RunRecord) -> RunRecord | None:
            return msgspec.structs.replace(r, state=RunState.COMPLETED, step=10, digest="d")

        assert await runs.update(RUN, complete) is not None  # ... and the writer dies here
        assert await asyncio.wait_for(watching, 10) is True, "watch did not see COMPLETED"
        assert "completed at step 10 (from the run record" in out.getvalue(), out.getvalue()

        # The usual way still ends on the event; a failed run's record ends it with False.
        again = asyncio.create_task(watch.watch_run(nc, RUN, Console(file=io.StringIO()), True))
        await emit(js, Completed(run_id=RUN, step=10, digest="d"), msg_id=f"completed.{RUN}")
        assert await asyncio.wait_for(again, 10) is True

        other = "r0123456789abcdef0001"
        await runs.create(msgspec.structs.replace(running, run_id=other, state=RunState.FAILED))
        out = io.StringIO()
        assert (
            await asyncio.wait_for(watch.watch_run(nc, other, Console(file=out), False), 10)
            is False
        )
    finally:
        await nc.close()
