"""How a run ends, against a real nats-server: one record change, one event under the run's
one id for it, repaired when the writer died in between, retried through an outage."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client

from baton.client.calls import history
from baton.stack.natsserver import NatsServer
from services.reaper.service import Reaper
from shared import config
from shared.bus import names
from shared.bus.connect import connect
from shared.bus.streams import ensure
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Cancelled, Completed, Event, Failed
from shared.state.endings import repair, settle, terminal_event
from shared.state.runs import Change, Runs
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)


async def running(nc: Client, run_id: str) -> Runs:
    runs = await Runs.open(nc.jetstream())
    now = time.time()
    record = RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=RunState.RUNNING, token=1, worker="w",
    )  # fmt: skip
    assert await runs.create(record)
    return runs


def complete(r: RunRecord) -> RunRecord | None:
    if r.state.terminal:
        return None
    return msgspec.structs.replace(r, state=RunState.COMPLETED, step=5, digest="d" * 64)


def endings_of(events: list[Event]) -> list[Event]:
    """The terminal events, without their publishing time."""
    ended = (e for e in events if isinstance(e, Completed | Failed | Cancelled))
    return [msgspec.structs.replace(e, at=0.0) for e in ended]


async def test_an_ending_writes_the_record_then_its_event_once(declared: Client) -> None:
    nc = declared
    js = nc.jetstream()
    runs = await running(nc, "r1")
    record = await settle(js, runs, "r1", complete)
    assert record is not None and record.state is RunState.COMPLETED
    found = await runs.get("r1")
    assert found is not None and not found[0].announce_pending and found[0].ending_site == ""
    # A second writer finds the run over: its change is refused, nothing is published.
    assert await settle(js, runs, "r1", complete) is None
    assert endings_of(await history(nc, "r1")) == [
        Completed(run_id="r1", step=5, digest="d" * 64, metrics={}, at=0.0)
    ]


async def test_a_change_that_does_not_end_the_run_publishes_nothing(declared: Client) -> None:
    nc = declared
    runs = await running(nc, "r2")
    record = await settle(
        nc.jetstream(), runs, "r2", lambda r: msgspec.structs.replace(r, retries=1)
    )
    assert record is not None and record.retries == 1 and not record.announce_pending
    assert await history(nc, "r2") == []


async def test_repair_publishes_a_missing_event_once_and_never_a_second(
    declared: Client,
) -> None:
    nc = declared
    js = nc.jetstream()
    runs = await running(nc, "r3")

    def fail_unannounced(r: RunRecord) -> RunRecord | None:
        # What a writer killed after the record change leaves behind.
        return msgspec.structs.replace(
            r, state=RunState.FAILED, reason="boom", announce_pending=True
        )

    left = await runs.update("r3", fail_unannounced)
    assert left is not None
    assert await repair(js, runs, left) is True
    assert await repair(js, runs, left) is False  # the event is there now: only the mark
    assert endings_of(await history(nc, "r3")) == [Failed(run_id="r3", reason="boom", at=0.0)]
    found = await runs.get("r3")
    assert found is not None and not found[0].announce_pending


async def test_repair_of_an_announced_ending_only_clears_the_mark(declared: Client) -> None:
    nc = declared
    js = nc.jetstream()
    runs = await running(nc, "r4")
    record = await settle(js, runs, "r4", complete)
    assert record is not None
    # The writer published the event, then died before clearing the mark.
    pending = await runs.update("r4", lambda r: msgspec.structs.replace(r, announce_pending=True))
    assert pending is not None
    assert await repair(js, runs, pending) is False
    assert len(endings_of(await history(nc, "r4"))) == 1


async def test_the_reaper_repairs_after_a_lease_ttl_and_only_then(
    declared: Client, tmp_path: Path
) -> None:
    nc = declared
    runs = await running(nc, "r5")
    cancelled = await runs.update(
        "r5",
        lambda r: msgspec.structs.replace(
            r, state=RunState.CANCELLED, reason="stop", announce_pending=True
        ),
    )
    assert cancelled is not None
    settings = config.load({"BATON_LEASE_TTL": "2", "BATON_STORE": f"file://{tmp_path}"})
    reaper = Reaper(nc, settings)
    await reaper.start()
    try:
        await reaper.sweep()  # first sighting: its writer may still be publishing
        assert await history(nc, "r5") == []

        async def repaired() -> bool:
            await reaper.sweep()
            found = await runs.get("r5")
            return found is not None and not found[0].announce_pending

        await eventually(repaired, 15, "the reaper to repair the ending")
        await reaper.sweep()
        assert endings_of(await history(nc, "r5")) == [
            Cancelled(run_id="r5", reason="stop", at=0.0)
        ]
    finally:
        await reaper.close()


async def test_an_ending_waits_out_an_outage(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats", port=0)
    await server.start()
    nc = await connect(server.url, "test", first_attempt_timeout=5)
    try:
        js = nc.jetstream()
        await ensure(js)
        await running(nc, "r6")
        runs = Failing(await Runs.open(js))
        await server.stop()
        ending = asyncio.create_task(settle(js, runs, "r6", complete))
        await asyncio.wait_for(runs.failed.wait(), 60)
        await server.start()
        record = await asyncio.wait_for(ending, 60)
        assert record is not None and record.state is RunState.COMPLETED
        assert len(endings_of(await history(nc, "r6"))) == 1
    finally:
        await nc.close()
        await server.stop()


class Failing(Runs):
    """Runs that tells when a write has failed (the server is down)."""

    def __init__(self, runs: Runs) -> None:
        super().__init__(runs._js, runs._kv, runs._writer)
        self.failed = asyncio.Event()

    async def update(self, run_id: str, change: Change) -> RunRecord | None:
        try:
            return await super().update(run_id, change)
        except Exception:
            self.failed.set()
            raise


def test_the_terminal_event_comes_from_the_record_alone() -> None:
    now = time.time()
    base = RunRecord(
        run_id="r", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now
    )
    done = msgspec.structs.replace(
        base, state=RunState.COMPLETED, step=7, digest="e", metrics={"loss": 0.5}
    )
    assert endings_of([terminal_event(done)]) == [
        Completed(run_id="r", step=7, digest="e", metrics={"loss": 0.5}, at=0.0)
    ]
    failed = msgspec.structs.replace(base, state=RunState.FAILED, reason="x")
    assert endings_of([terminal_event(failed, "tail")]) == [
        Failed(run_id="r", reason="x", detail="tail", at=0.0)
    ]
    assert names.ending_id("failed", "r") == "failed.r"
