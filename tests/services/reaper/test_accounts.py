"""The reaper exports a run's goodput once, when it sees the run it saw running end — and
not before its terminal event is stored."""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client

from services.reaper.accounts import Accounts
from shared import telemetry
from shared.bus.emit import emit
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Accepted, Completed, Progress, Restored, Started
from tests.support.otel import metric_points, sinks

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 20, "pool": "gp"}, JobSpec)


def record(run_id: str, state: RunState) -> RunRecord:
    now = time.time()
    return RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=state,
    )  # fmt: skip


def seconds_of(pool: str) -> dict[str, float]:
    points = metric_points(sinks()[1]).get("baton.run.seconds", [])
    return {
        str(p.attributes[telemetry.CATEGORY]): p.value
        for p in points
        if p.attributes.get(telemetry.POOL) == pool
    }


async def test_a_run_seen_running_is_exported_once_when_its_end_is_stored(
    declared: Client,
) -> None:
    sinks()
    js = declared.jetstream()
    accounts = Accounts(js)
    running, old = record("racc", RunState.RUNNING), record("rold", RunState.COMPLETED)
    assert await accounts.sweep([running, old]) == []  # `rold` ended before we looked
    t = time.time() - 10
    for e in (
        Accepted(run_id="racc", name="t", pool="gp", total_steps=20, at=t),
        Started(run_id="racc", worker="w", token=1, attempt=1, start_step=0, at=t + 1),
        Restored(run_id="racc", worker="w", step=0, at=t + 2),
        Progress(run_id="racc", step=20, total_steps=20, worker="w", at=t + 6),
    ):
        await emit(js, e)
    ended = msgspec.structs.replace(running, state=RunState.COMPLETED)
    assert await accounts.sweep([ended, old]) == [], "no terminal event yet: not final"
    await emit(js, Completed(run_id="racc", step=20, digest="d", at=t + 6.5))
    assert await accounts.sweep([ended, old]) == ["racc"]
    assert await accounts.sweep([ended, old]) == [], "exported once"
    got = seconds_of("gp")
    assert got["productive"] == 4.0 and got["queued"] == 1.0 and got["startup"] == 1.0
    assert abs(sum(got.values()) - 6.5) < 1e-9
    goodputs = metric_points(sinks()[1])["baton.run.goodput"]
    assert [p.count for p in goodputs if p.attributes.get(telemetry.POOL) == "gp"] == [1]
