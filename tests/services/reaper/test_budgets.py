"""Budget warnings: the threshold arithmetic, and the reaper's sweep emitting each once, on a
real nats-server under `baton up`'s authorization (the reaper as its own role)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from nats.aio.client import Client

from baton.client import calls as client
from services.reaper import budgets
from services.reaper.service import Reaper
from shared import config
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState, convert, encode, spec_hash
from shared.contracts.events import RunWarning, Started
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub
from tests.support.stack import eventually


@pytest.mark.parametrize(
    ("spent", "due"),
    [
        (0.0, []),
        (0.2499, []),
        (0.25, ["budget_25"]),
        (0.5, ["budget_25", "budget_50"]),
        (0.74, ["budget_25", "budget_50"]),
        (0.99, ["budget_25", "budget_50", "budget_75"]),
        (1.0, ["budget_25", "budget_50", "budget_75", "budget_100"]),
        (7.0, ["budget_25", "budget_50", "budget_75", "budget_100"]),
    ],
)
def test_each_quarter_reached_is_due(spent: float, due: list[str]) -> None:
    assert budgets.crossed(spent, 1.0) == due
    assert budgets.crossed(spent * 40, 40.0) == due


def test_spend_is_what_was_booked_and_the_running_attempt_at_the_rate() -> None:
    assert budgets.spend(0.5, 1800, 2.0) == pytest.approx(1.5)  # half an hour at 2/hour
    assert budgets.spend(0.5, -3, 2.0) == 0.5  # a server clock that stepped back adds nothing
    assert budgets.spend(0.5, 1800, 0.0) == 0.5  # a pool without a rate costs nothing
    assert budgets.crossed(123.0, 0.0) == []  # a budget of 0 is never "reached"


async def created(nc: Client, run_id: str, **over: object) -> None:
    spec = convert(
        {"name": "b", "entry_point": "m:f", "total_steps": 5, "limits": over.pop("limits")},
        JobSpec,
    )
    now = time.time()
    fields: dict[str, object] = {"created_at": now, "updated_at": now, **over}
    record = RunRecord(run_id=run_id, spec=spec, spec_hash=spec_hash(spec), **fields)  # type: ignore[arg-type]
    assert await (await Runs.open(nc.jetstream())).create(record)


async def warnings(nc: Client, run_id: str) -> list[str]:
    return [e.kind for e in await client.history(nc, run_id) if isinstance(e, RunWarning)]


async def test_the_sweep_warns_once_per_quarter_of_a_budget(
    authorized: AuthorizedHub, tmp_path: Path
) -> None:
    pools = tmp_path / "pools.toml"
    pools.write_text("[pools.default]\nrate_per_hour = 3600\n")  # one per second
    nc = await authorized.connect("operator")
    # Booked by ended attempts: 0.6 of 1, waiting for its next attempt.
    await created(nc, "rbooked", limits={"max_cost": 1.0}, actual_cost=0.6)
    # Running under token 7 since its `started` (stamped now): spends a unit a second.
    await created(
        nc, "rrunning", limits={"max_cost": 4.0}, state=RunState.RUNNING, token=7, worker="w"
    )
    await nc.jetstream().publish(
        names.event_subject("rrunning", "started"),
        encode(Started(run_id="rrunning", worker="w", token=7, attempt=1, start_step=0)),
    )
    # Its record names token 9 but its last `started` token 8: no running time is counted.
    await created(
        nc, "rstale", limits={"max_cost": 0.5}, state=RunState.RUNNING, token=9, worker="w"
    )
    await nc.jetstream().publish(
        names.event_subject("rstale", "started"),
        encode(Started(run_id="rstale", worker="w", token=8, attempt=1, start_step=0)),
    )
    settings = config.load(
        {
            "BATON_LEASE_TTL": "60",
            "BATON_STORE": f"file://{tmp_path}",
            "BATON_POOLS_FILE": str(pools),
        }
    )
    reaper = Reaper(await authorized.connect("reaper"), settings)
    await reaper.start()
    try:
        await reaper.sweep()
        assert await warnings(nc, "rbooked") == ["budget_25", "budget_50"]

        async def warned_running() -> list[str]:
            await reaper.sweep()
            return await warnings(nc, "rrunning")

        assert await eventually(warned_running, 30, "a quarter of rrunning's budget") != []
        await reaper.sweep()
        assert await warnings(nc, "rbooked") == ["budget_25", "budget_50"], "warned twice"
        assert await warnings(nc, "rstale") == [], "another attempt's time was counted"
        found = await (await Runs.open(nc.jetstream())).get("rbooked")
        assert found is not None and found[0].warned == ["budget_25", "budget_50"]
        detail = next(
            e.detail for e in await client.history(nc, "rrunning") if isinstance(e, RunWarning)
        )
        assert "of max_cost 4" in detail and "at 3600/hour" in detail, detail
    finally:
        await reaper.lapses.stop()
        await reaper.close()
