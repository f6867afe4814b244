"""The reaper exports a run's goodput once, when it sees the run it saw running end — and
not before its terminal event is stored. Its code runs as the `reaper` user of a server
with `baton up`'s authorization: what it reads, its role must allow."""

from __future__ import annotations

import time

import msgspec
import pytest

from services.reaper.accounts import Accounts
from shared import telemetry
from shared.bus.emit import emit
from shared.bus.history import run_events
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Accepted, Completed, Progress, Restored, Started
from shared.history.goodput import goodput
from tests.support.otel import metric_points, sinks
from tests.support.roles import AuthorizedHub

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
    authorized: AuthorizedHub,
) -> None:
    """Its trainer's clock is 5 minutes ahead of the hub's: its events' `at` say so, and the
    exported seconds do not (the events are put on the hub's clock first)."""
    sinks()
    js = (await authorized.connect("operator")).jetstream()  # the run's publishers
    accounts = Accounts((await authorized.connect("reaper")).jetstream())
    running, old = record("racc", RunState.RUNNING), record("rold", RunState.COMPLETED)
    assert await accounts.sweep([running, old]) == []  # `rold` ended before we looked

    def ahead() -> float:  # the trainer's clock
        return time.time() + 300

    await emit(js, Accepted(run_id="racc", name="t", pool="gp", total_steps=20))
    await emit(js, Started(run_id="racc", worker="w", token=1, attempt=1, start_step=0, at=ahead()))
    await emit(js, Restored(run_id="racc", worker="w", step=0, at=ahead()))
    await emit(js, Progress(run_id="racc", step=20, total_steps=20, worker="w", at=ahead()))
    ended = msgspec.structs.replace(running, state=RunState.COMPLETED)
    assert await accounts.sweep([ended, old]) == [], "no terminal event yet: not final"
    await emit(js, Completed(run_id="racc", step=20, digest="d", at=ahead()))
    assert await accounts.sweep([ended, old]) == ["racc"]
    assert await accounts.sweep([ended, old]) == [], "exported once"
    got = seconds_of("gp")
    spent = goodput(await run_events(js, "racc"))
    assert spent is not None and spent.finished
    assert got == pytest.approx(spent.seconds(), abs=1e-9)
    # No category holds the 5 minutes between the trainer's clock and the hub's.
    assert all(v >= 0 for v in got.values()) and 0 < spent.wall_s < 60, got
    assert sum(got.values()) == pytest.approx(spent.wall_s)
    goodputs = metric_points(sinks()[1])["baton.run.goodput"]
    assert [p.count for p in goodputs if p.attributes.get(telemetry.POOL) == "gp"] == [1]
