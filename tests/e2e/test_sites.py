"""Edge sites under chaos: a leaf node behind a proxy that the tests cut, blackhole and
restore, with trainers at the site taking the hub's work.

Each test runs the real hub (nats-server in domain `hub`, dispatcher, checkpointer, reaper
as processes) and a real site (leaf nats-server in its own domain, the site's checkpointer
and trainers). Every fault is undone by the harness, also when a test fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared import names
from shared.contracts import JobSpec, RunState
from shared.contracts.events import Completed, Progress, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.sites import Site, stored
from tests.support.stack import Stack

PACED = "tests.support.workloads:paced"
TTL = 6
HUB_ONLY = ("dispatcher", "checkpointer", "reaper")
HUB_ORIGIN = ("accepted", "dispatched")
"""Event kinds the hub's own services emit; everything else of a run at a site comes from
the site's outbox."""


def paced(total: int = 120, every: int = 10, pace: float = 0.05, **over: Any) -> JobSpec:
    return job(
        entry_point=PACED,
        total_steps=total,
        checkpoint={"every_steps": every},
        config={"pace": pace},
        seed=11,
        **over,
    )


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL)
    await s.start(HUB_ONLY)
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def site(hub: Stack) -> Site:
    s = Site(hub, "lab1")
    await s.start(trainers=1)
    return s


async def test_a_site_trains_the_hubs_work(hub: Stack, site: Site) -> None:
    nc = await hub.client()
    run_id = await submit(nc, paced(total=30, pace=0.0))
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.COMPLETED, record
    log = EventLog(nc, run_id)
    done = await log.wait_for(lambda e: isinstance(e, Completed), 10, "completed at the hub")
    assert isinstance(done, Completed) and done.step == 30
    started = log.of(Started)
    assert [s.worker for s in started] == ["lab1-trainer-1"], started
    log.close()
    sent = await site.outbox(names.at_site(names.events_of_run(run_id), "lab1"))
    got = await stored(nc, names.EVENTS_STREAM, names.events_of_run(run_id))
    from_site = [(subj, data) for subj, data in got if subj.rsplit(".", 1)[1] not in HUB_ORIGIN]
    want = [(names.event_subject(run_id, "x").rsplit(".", 1)[0] + "." + s.rsplit(".", 1)[1], d)
            for s, d in sent]
    assert from_site == want, "the hub must hold the site's events once each, in order"
    assert any(isinstance(e, Progress) for e in log.events)
