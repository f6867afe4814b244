"""Grants by time keep a cut-off site busy for as long as the work it was granted lasts
(`shared.scheduling.horizon`): the hub (dispatcher, checkpointer, reaper; no trainer)
grants the site `lab1` (leaf node, checkpointer, two trainers) queued work up to
`BATON_GRANT_AHEAD_S` of expected seconds per trainer, and a cut far longer than grants by
count would last (one run ahead per trainer) leaves its trainers training throughout. Real
processes under `baton up`'s default authorization; every stack's logs are scanned for
permission violations and JetStream API timeouts when it stops.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest

from shared.contracts import RunState
from shared.contracts.events import Fenced, Started
from tests.e2e.jobs import finished, history, paced, submit
from tests.e2e.test_grants import HUB_ONLY, TTL, _completed_once, of, records, site_events
from tests.support.busy import busy_within
from tests.support.busy import site_events as all_site_events
from tests.support.cli import as_json
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.sites, pytest.mark.timeout(600)]

RUNS = 16
STEPS = 100
PACE = 0.08
RUN_S = STEPS * PACE
"""Each run's `estimate_s`: what its expected seconds are reckoned from."""
HORIZON_S = 120


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(
        tmp_path / "hub", trainers=0, lease_ttl=TTL,
        env={"BATON_GRANT_AHEAD_S": str(HORIZON_S)},
    )  # fmt: skip
    await s.start(HUB_ONLY)
    try:
        yield s
    finally:
        await s.stop()


async def test_a_site_granted_by_time_trains_through_a_cut_longer_than_counted_grants_last(
    hub: Stack,
) -> None:
    """Sixteen runs of ~8 s, two trainers: by count (one ahead per trainer) the site would
    hold four runs, about 16 s of work each trainer; by time it is granted all sixteen
    before the cut. Cut until every run completed at the site: its trainers trained nearly all of
    the cut (from the site's events), and at heal every run is COMPLETED once at the hub,
    with the uninterrupted run's weights."""
    site = Site(hub, "lab1")
    await site.start(trainers=2)
    nc = await hub.client()
    reference = await submit(nc, paced(STEPS, pace=0.0, name="reference"))
    want = (await finished(nc, reference, timeout=120)).digest
    assert want

    run_ids = [
        await submit(nc, paced(STEPS, pace=PACE, name="timed", estimate_s=RUN_S))
        for _ in range(RUNS)
    ]

    async def granted_and_two_training() -> bool:
        rs = await records(nc, run_ids)
        running = [r for r in rs if r.state is RunState.RUNNING]
        return all(r.site == "lab1" for r in rs) and len(running) == 2

    await eventually(granted_and_two_training, 120, "every run granted, two training")
    [view] = await as_json(hub, "sites")
    assert view["held"] == RUNS and view["trainers"] == 2, view
    # Far more than one run ahead per trainer: its horizon, in expected seconds.
    assert 3 * RUN_S < view["horizon_s"] <= RUNS * RUN_S / 2, view

    site.proxy.sever()
    cut_at = time.time()

    async def done_at_site() -> bool:
        return all([await site_events(site, r, "completed") for r in run_ids])

    await eventually(done_at_site, 400, "every run to complete at the cut-off site")
    events = await all_site_events(site)
    site.proxy.restore()

    # The cut as the site lived it: from the sever to its last run's completion.
    last = max(e.at for kind, e in events if kind == "completed" and e.run_id in run_ids)
    busy = busy_within(events, cut_at, last)
    window = last - cut_at
    counted = 2 * RUN_S  # what a trainer's run and one ahead (grants by count) last
    assert window > 3 * counted, f"the cut lasted {window:.0f}s: not longer than counted grants"
    share = busy / (2 * window)
    print(f"cut {window:.1f}s, trainers busy {share:.1%} of it")
    assert share >= 0.8, f"busy {busy:.0f} trainer-s of {2 * window:.0f}"

    for run_id in run_ids:
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED and record.digest == want, record
        assert record.attempts == 1, f"{run_id} trained again: {record.attempts} attempts"
        await eventually(partial(_completed_once, nc, run_id), 60, f"{run_id}'s events at hub")
        at_hub = await history(nc, run_id)
        assert len(of(at_hub, Started)) == 1 and not of(at_hub, Fenced), run_id
        await site.assert_events_once_in_order(nc, run_id)
