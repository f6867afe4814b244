"""A site trains the hub's work: the plain path, and what `baton sites` shows of it.

The hub (nats-server in domain `hub`, dispatcher, checkpointer, reaper) and the site
`lab1` (leaf nats-server in its own domain, the site's checkpointer and trainer) are real
processes; the chaos tests (test_chaos.py) cut the link between them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from baton.cli.app import app
from shared.contracts import RunState
from shared.contracts.events import Completed, GroupFormed, Started
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

HUB_ONLY = ("dispatcher", "checkpointer", "reaper")


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=6)
    await s.start(HUB_ONLY)
    try:
        yield s
    finally:
        await s.stop()


async def test_a_site_trains_the_hubs_work(hub: Stack) -> None:
    site = Site(hub, "lab1")
    await site.start(trainers=2)
    nc = await hub.client()
    run_id = await submit(nc, job(total_steps=30))
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.COMPLETED and record.step == 30, record
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Completed), 10, "completed at the hub")
    assert [s.worker for s in log.of(Started)] in (["lab1-trainer-1"], ["lab1-trainer-2"])
    log.close()
    await site.assert_events_once_in_order(nc, run_id)

    # A group of ranks led at the site: its calls reach the hub's work queue through the
    # site's outbox, and the site's other trainer takes one.
    ddp = job(entry_point="examples.ddp:train", total_steps=40, ranks=2, config={})
    run_id = await submit(nc, ddp)
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED, record.reason
    formed = [e for e in await history(nc, run_id) if isinstance(e, GroupFormed)]
    assert len(formed) == 1 and sorted(formed[0].members) == ["lab1-trainer-1", "lab1-trainer-2"]
    await site.assert_events_once_in_order(nc, run_id)


async def test_baton_sites_shows_the_link_and_its_loss(hub: Stack) -> None:
    runner = CliRunner()

    def sites() -> list[dict[str, object]]:
        operator = str(hub.root / "auth" / "operator.env")
        result = runner.invoke(
            app, ["--auth-file", operator, "sites", "--json", "-s", hub.nats.url]
        )
        assert result.exit_code == 0, result.output
        return list(json.loads(result.stdout))

    assert await _in_thread(sites) == [], "no site has greeted the hub yet"
    site = Site(hub, "lab1")
    await site.start(trainers=0)

    async def link(state: str) -> bool:
        found = await _in_thread(sites)
        return len(found) == 1 and found[0]["site"] == "lab1" and found[0]["link"] == state

    await eventually(lambda: link("up"), 20, "lab1 to show as up")
    site.proxy.sever()
    await eventually(lambda: link("down"), 20, "lab1 to show as down")
    site.proxy.restore()
    await eventually(lambda: link("up"), 20, "lab1 to show as up again")
    [view] = await _in_thread(sites)
    assert view["links"] == 2, f"the link came up twice: {view}"


async def _in_thread(fn: Callable[[], list[dict[str, object]]]) -> list[dict[str, object]]:
    """The CLI runs its own event loop, so it cannot run on the test's."""
    return await asyncio.to_thread(fn)
