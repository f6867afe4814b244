"""The dashboard's ages and durations are the hub's, whatever its writers' clocks say: a run's
timeline and goodput from its events put on the hub's clock, and every age a page shows from
the server's stamp and the hub's now — against a real nats-server, with heartbeats, records
and dead letters written 5 minutes ahead of and behind this host's clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from baton.ui.views import run_view
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, RunState, convert, encode, spec_hash
from shared.contracts.control import WorkerInfo
from shared.contracts.events import Accepted, Completed, Event, Started
from shared.contracts.letters import DeadLetter
from shared.contracts.sites import SiteRecord
from shared.state.clock import ServerClock, server_now
from shared.state.runs import Runs
from tests.support.dashboard import events, get, served
from tests.support.stack import eventually

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
SKEW = 300.0
"""Five minutes: what a writer's clock is off by here."""
NEAR = 60.0
"""An age "near 0": far below SKEW, with room for a loaded machine."""
HUB0 = 1_800_000_000.0


def record(run_id: str, state: RunState, at: float) -> RunRecord:
    return RunRecord(
        run_id=run_id, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=at, updated_at=at,
        state=state, step=5 if state.terminal else 0,
    )  # fmt: skip


def test_a_run_view_is_on_the_hub_clock_whatever_its_trainers_clock_says() -> None:
    """A trainer 5 minutes ahead: its raw times would make the run queue for 5 minutes."""
    history: list[Event] = [
        Accepted(run_id="r1", at=HUB0 - 2.0, name="t", pool="default", total_steps=5),
        Started(run_id="r1", at=HUB0 + 1 + SKEW, worker="t1", token=1, attempt=1, start_step=0),
        Completed(run_id="r1", at=HUB0 + 11 + SKEW, step=5, digest="d"),
    ]
    stamps = [HUB0, HUB0 + 1.05, HUB0 + 11.1]
    view = run_view(record("r1", RunState.COMPLETED, HUB0), history, stamps, 3, HUB0 + 50)
    assert view["now"] == HUB0 + 50
    assert view["accepted_at"] == HUB0  # the dispatcher's event: at its stamp
    [attempt] = view["attempts"]
    assert attempt["start"] == pytest.approx(HUB0 + 1.05)  # its trainer's only event
    assert [m["at"] for m in view["marks"]] == pytest.approx(stamps)
    spent = view["goodput"]
    assert spent["wall_s"] == pytest.approx(11.1)
    assert spent["queued_s"] == pytest.approx(1.05), "no phantom 5 minutes"

    # A live run lasts until the hub's now, which is on the same clock.
    live = run_view(record("r1", RunState.RUNNING, HUB0), history[:2], stamps[:2], 2, HUB0 + 50)
    assert live["goodput"]["wall_s"] == pytest.approx(50.0)


async def test_the_hubs_clock_is_read_once_and_carried_on_the_monotonic_clock(
    declared: Client,
) -> None:
    clock = ServerClock(declared, f"KV_{names.RUNS_BUCKET}", resync_s=3600)
    with pytest.raises(RuntimeError):
        clock.now()
    synced = await clock.sync()
    carried = clock.now()
    fresh = await server_now(declared, f"KV_{names.RUNS_BUCKET}")
    assert synced <= carried and abs(fresh - carried) < 5
    assert await clock.read() >= carried  # not due: carried, not asked
    with pytest.raises(RuntimeError):
        await ServerClock(declared, "NO_SUCH_STREAM").sync()


async def skewed_fleet(nc: Client) -> None:
    """A trainer, a site, a run and a dead letter each 5 minutes ahead, and each 5 behind."""
    js = nc.jetstream()
    workers = await js.key_value(names.WORKERS_BUCKET)
    sites = await js.key_value(names.SITES_BUCKET)
    runs = await Runs.open(js)
    for name, off in (("ahead", SKEW), ("behind", -SKEW)):
        at = time.time() + off
        info = WorkerInfo(worker=f"w-{name}", pool="p", host="h", pid=1, device="cpu", at=at)
        await workers.put(info.worker, encode(info))
        site = SiteRecord(site=f"s-{name}", first_seen=at, last_hello=at, linked_at=at)
        await sites.put(site.site, encode(site))
        assert await runs.create(record(f"r-{name}", RunState.RUNNING, at))
        event = Accepted(run_id=f"r-{name}", at=at, name="t", pool="p", total_steps=5)
        await js.publish(names.event_subject(f"r-{name}", "accepted"), encode(event))
        letter = DeadLetter(
            source=name, subject=names.submit_subject("p"), reason="test", payload=b"{}",
            headers={}, stream_seq=1, delivered=10, at=at,
        )  # fmt: skip
        await js.publish(names.dlq_subject(name), encode(letter))


def hub_age(item: dict[str, Any], now: float | None = None) -> float:
    """What the page shows: the hub's now less the hub's stamp (none of this host's time
    passes between the reply and this reading that matters at NEAR)."""
    return float((item["now"] if now is None else now) - item["stamped_at"])


async def next_worker(stream: AsyncGenerator[tuple[str, Any], None], worker: str) -> Any:
    async for kind, data in stream:
        if kind == "worker" and data["worker"] == worker:
            return data
    raise AssertionError("the live stream ended")


async def test_ages_on_the_dashboard_are_near_0_for_writers_5_minutes_off(
    declared: Client, tmp_path: Path
) -> None:
    await skewed_fleet(declared)
    async with served(declared, f"file://{tmp_path}/store") as url:
        workers = await get(f"{url}api/workers")
        assert [w["worker"] for w in workers] == ["w-ahead", "w-behind"]
        for w in workers:
            assert 0 <= hub_age(w) < NEAR, w
            assert abs(w["stamped_at"] - w["at"]) > SKEW / 2  # its own clock: shown as written

        page = await get(f"{url}api/runs")
        assert {r["run_id"] for r in page["runs"]} == {"r-ahead", "r-behind"}
        for r in page["runs"]:
            assert 0 <= hub_age(r, page["now"]) < NEAR, r

        letters = await get(f"{url}api/dlq")
        assert len(letters["letters"]) == 2 and letters["total"] == 2, letters
        for letter in letters["letters"]:
            assert 0 <= hub_age(letter, letters["now"]) < NEAR, letter

        sites = await get(f"{url}api/sites")
        assert [s["site"] for s in sites] == ["s-ahead", "s-behind"]
        for s in sites:
            assert 0 <= s["last_seen_s"] < NEAR, s

        for run_id in ("r-ahead", "r-behind"):
            view = await get(f"{url}api/runs/{run_id}")
            assert 0 <= view["now"] - view["accepted_at"] < NEAR, view
            assert view["goodput"]["wall_s"] < NEAR

        # A heartbeat pushed live carries the server's stamp of its entry and the hub's now.
        stream = events(url, "/api/live")
        pushed = asyncio.ensure_future(next_worker(stream, "w-late"))

        async def following() -> bool:
            return bool((await get(f"{url}api/meta"))["following"] == 1)

        try:
            await eventually(following, 30, "the browser to follow the live stream")
            info = WorkerInfo(
                worker="w-late", pool="p", host="h", pid=1, device="cpu", at=time.time() - SKEW
            )
            kv = await declared.jetstream().key_value(names.WORKERS_BUCKET)
            await kv.put(info.worker, encode(info))
            beat = await asyncio.wait_for(pushed, 30)
            assert 0 <= hub_age(beat) < NEAR and beat["at"] == info.at, beat
        finally:
            pushed.cancel()
            with contextlib.suppress(BaseException):
                await pushed
            await stream.aclose()
