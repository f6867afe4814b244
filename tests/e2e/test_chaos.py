"""Chaos across the WAN link: cuts, a blackhole, a hub crash — with trainers at a site.

The hub (nats-server in domain `hub`, dispatcher, checkpointer, reaper) and the site `lab1`
(leaf nats-server in its own domain behind a `Proxy`, its checkpointer and trainer) are
real processes. Each fault is bounded: the test waits on a condition with a deadline, then
undoes it; the harness undoes it again on the way out if the test failed first.

Jobs submitted at a site while it is cut off are dispatched there (tests/e2e/test_grants.py).

What "exactly once and in order" means here: the hub's events of a run that came from the
site are, message for message, the site's outbox in the order the site stored it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.contracts import RunState, decode
from shared.contracts.control import WorkerInfo
from shared.contracts.events import Completed, Fenced, Progress, Redispatched, Restored, Started
from shared.state.lease import holder
from shared.state.workers import live_workers
from tests.e2e.jobs import EventLog, finished, paced, submit
from tests.support.sites import Site, hub_leaves
from tests.support.stack import Stack, eventually

TTL = 6
HUB_ONLY = ("dispatcher", "checkpointer", "reaper")
EDGE = "lab1-trainer-1"
_references: dict[tuple[int, int], str] = {}


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    # Runs held by the hub, trained across the link (grants off): the path of runs of
    # several ranks and of sites that take no grants. Granted runs through cuts are
    # tests/e2e/test_grants.py's.
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL, env={"BATON_DELEGATE_AHEAD": "0"})
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


async def reference(nc: Client, total: int) -> str:
    """The digest of an uninterrupted run (pace only sleeps, so a fast one will do)."""
    key = (total, 11)
    if key not in _references:
        rec = await finished(nc, await submit(nc, paced(total, pace=0.0)), timeout=60)
        assert rec.state is RunState.COMPLETED and rec.digest, rec
        _references[key] = rec.digest
    return _references[key]


async def progressed_at_site(site: Site, run_id: str, beyond: int) -> int | None:
    """The newest step the site's outbox has for the run, once it is past `beyond`."""
    sent = await site.outbox(names.at_site(names.event_subject(run_id, "progress"), site.name))
    steps = [decode(d, Progress).step for _, d in sent]
    return max(steps) if steps and max(steps) > beyond else None


async def worker_info(nc: Client, worker: str) -> WorkerInfo | None:
    return next((w for w in await live_workers(nc.jetstream()) if w.worker == worker), None)


async def test_cut_shorter_than_the_ttl_costs_nothing(hub: Stack, site: Site) -> None:
    nc = await hub.client()
    run_id = await submit(nc, paced(160))
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    cut_at = time.monotonic()
    site.proxy.sever()
    # Cut until the edge trainer has failed to renew its lease at least once, and has
    # trained on meanwhile (its progress is in the outbox, not at the hub).
    failures = hub.log(EDGE).count("lease renewal failed")
    await eventually(
        lambda: _async(hub.log(EDGE).count("lease renewal failed") > failures),
        TTL, "a failed renewal during the cut",
    )  # fmt: skip
    seen = max(e.step for e in log.of(Progress))
    await eventually(lambda: progressed_at_site(site, run_id, seen + 5), TTL, "training on")
    site.proxy.restore()
    assert time.monotonic() - cut_at < TTL, "the cut must stay shorter than the TTL"
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.COMPLETED, record
    await log.wait_for(lambda e: isinstance(e, Completed), 20, "completed at the hub")
    started = log.of(Started)
    assert [s.worker for s in started] == [EDGE], f"no restart expected: {started}"
    assert record.attempts == 1 and record.token == started[0].token, record
    assert not log.of(Fenced) and not log.of(Redispatched)
    log.close()
    await site.assert_events_once_in_order(nc, run_id)


async def test_long_cut_hands_the_run_to_the_hub_and_fences_the_edge(
    hub: Stack, site: Site
) -> None:
    nc = await hub.client()
    want = await reference(nc, 300)
    run_id = await submit(nc, paced(300, pace=0.06))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start at the edge")
    assert isinstance(first, Started) and first.worker == EDGE
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    await hub.add_trainer("hub-trainer-1")
    await eventually(lambda: worker_info(nc, "hub-trainer-1"), 30, "the hub trainer")
    site.proxy.sever()
    takeover = await log.wait_for(
        lambda e: isinstance(e, Started) and e.worker == "hub-trainer-1", 4 * TTL, "takeover"
    )
    assert isinstance(takeover, Started) and takeover.token > first.token
    site.proxy.restore()
    fenced = await log.wait_for(
        lambda e: isinstance(e, Fenced) and e.worker == EDGE, 6 * TTL, "the edge fenced"
    )
    assert isinstance(fenced, Fenced) and fenced.token < takeover.token
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED, record
    assert record.digest == want, "weights differ from the uninterrupted reference"
    # The edge trainer let go: its heartbeat names no run (its training process is dead).
    await eventually(lambda: _idle(nc, EDGE), 6 * TTL, "the edge trainer to hold no run")
    log.close()


async def test_long_cut_without_another_trainer_loses_no_step(hub: Stack, site: Site) -> None:
    nc = await hub.client()
    run_id = await submit(nc, paced(300))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start at the edge")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    site.proxy.sever()
    js = nc.jetstream()
    # Longer than the TTL: the hub sees the lease lapse, and the edge trains on.
    key = hub.lease_key(run_id)
    await eventually(lambda: _lapsed(js, key), 3 * TTL, "the lease to lapse at the hub")
    seen = max(e.step for e in log.of(Progress))
    await eventually(lambda: progressed_at_site(site, run_id, seen + 20), 30, "training on")
    site.proxy.restore()
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED and record.step == 300, record
    await log.wait_for(lambda e: isinstance(e, Completed), 20, "completed at the hub")
    assert len(log.of(Completed)) == 1
    assert [s.worker for s in log.of(Started)] == [EDGE], "one attempt, never restarted"
    restored = log.of(Restored)
    assert [r.step for r in restored] == [0], f"it never resumed from a checkpoint: {restored}"
    assert record.attempts == 1 and (record.token or 0) > first.token, "lease re-taken"
    assert not log.of(Fenced)

    async def acked() -> bool:  # the ack follows the record's update: wait for it
        try:
            await js.get_last_msg(names.TASKS_STREAM, names.task_subject("default", run_id))
        except NotFoundError:
            return True
        return False

    await eventually(acked, 20, "the task to be acked: nothing left to deliver again")
    log.close()
    await site.assert_events_once_in_order(nc, run_id)


async def finished_at_the_edge_cut_off(
    nc: Client, hub: Stack, site: Site, *, lapsed: bool
) -> tuple[str, str, EventLog]:
    """A hub run of 160 steps started at the edge, its link cut at step 20 (`lapsed`: and
    its lease then seen to lapse at the hub), until the edge finished it cut off: the
    uninterrupted run's digest, the run and its events."""
    want = await reference(nc, 160)
    run_id = await submit(nc, paced(160))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start at the edge")
    assert isinstance(first, Started) and first.worker == EDGE
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    site.proxy.sever()
    if lapsed:
        js = nc.jetstream()
        await eventually(lambda: _lapsed(js, hub.lease_key(run_id)), 3 * TTL, "the lease to lapse")

    async def ended_at_the_edge() -> bool:
        return f"{run_id}: completed at step 160" in hub.log(EDGE)

    await eventually(ended_at_the_edge, 60, "the run to finish at the edge, cut off")
    return want, run_id, log


async def test_a_run_that_ends_at_the_edge_during_a_long_cut_completes_once(
    hub: Stack, site: Site
) -> None:
    """The edge finishes the run while cut off for longer than the TTL: its ending waits
    for the link, and at heal it is written once — the lapsed lease is not taken back
    under the ending (which would refuse it as fenced and train the run a second time)."""
    nc = await hub.client()
    want, run_id, log = await finished_at_the_edge_cut_off(nc, hub, site, lapsed=True)
    site.proxy.restore()
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED and record.digest == want, record
    await log.wait_for(lambda e: isinstance(e, Completed), 20, "completed at the hub")
    assert record.attempts == 1, f"trained again after heal: {record.attempts} attempts"
    assert [s.worker for s in log.of(Started)] == [EDGE], "one attempt"
    assert len(log.of(Completed)) == 1 and not log.of(Fenced)
    log.close()
    await site.assert_events_once_in_order(nc, run_id)


@pytest.mark.adversary  # the same run at both sides of a cut: the adversary tier's
async def test_a_hub_run_the_edge_finished_during_a_cut_is_completed_from_the_store(
    hub: Stack, site: Site
) -> None:
    """The edge trains a hub task (not granted: its checkpoints are the hub's chain) and
    finishes it while cut off past the TTL; a hub trainer then takes the task. The store's
    final checkpoint is the hub's, so that attempt completes the run from it and trains
    nothing. (A chain written as the site's made the hub's attempt yield the run to a site
    that never reports a run it was not granted: RUNNING for ever.)"""
    nc = await hub.client()
    want, run_id, log = await finished_at_the_edge_cut_off(nc, hub, site, lapsed=False)
    await hub.add_trainer("hub-trainer-1")
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED and record.digest == want, record
    assert "completed from the store, nothing trained" in hub.log("hub-trainer-1")
    site.proxy.restore()
    await eventually(lambda: _idle(nc, EDGE), 6 * TTL, "the edge trainer to let the run go")
    await eventually(lambda: site.delivered(nc, run_id), 30, "the edge's events at the hub")
    assert [s.worker for s in log.of(Started)] == [EDGE], "nothing trained at the hub"
    assert len(log.of(Completed)) == 1, log.of(Completed)
    after = await finished(nc, run_id, timeout=5)
    assert (after.state, after.token, after.digest) == (record.state, record.token, want), after
    log.close()
    await site.assert_events_once_in_order(nc, run_id)


async def test_a_blackholed_link_is_noticed_then_healed_like_a_cut(hub: Stack, site: Site) -> None:
    nc = await hub.client()
    run_id = await submit(nc, paced(200))
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    assert await hub_leaves(hub) == 1
    site.proxy.blackhole()
    # Pings every 2 s, two missed: NATS measured ~5 s; a generous bound for a slow CI box.
    await eventually(lambda: _none(hub_leaves(hub)), 20, "the hub to drop the silent leaf")
    seen = max(e.step for e in log.of(Progress))
    await eventually(lambda: progressed_at_site(site, run_id, seen + 5), 20, "training on")
    site.proxy.restore()
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.COMPLETED, record
    await log.wait_for(lambda e: isinstance(e, Completed), 20, "completed at the hub")
    assert [s.worker for s in log.of(Started)] == [EDGE]
    log.close()
    await site.assert_events_once_in_order(nc, run_id)


async def test_hub_server_killed_and_restarted_mid_run(hub: Stack, site: Site) -> None:
    nc = await hub.client()
    want = await reference(nc, 200)
    run_id = await submit(nc, paced(200))
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 30, 30, "step 30")
    await hub.nats.restart(kill=True)
    restarted_at = time.time()
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record
    assert record.digest == want, "weights differ from the uninterrupted reference"
    # Every service came back by itself: a second job goes end to end, through the site.
    again = await submit(nc, paced(20, pace=0.0))
    assert (await finished(nc, again, timeout=60)).state is RunState.COMPLETED

    # The heartbeats' source too: a heartbeat of the edge trainer's from after the restart.
    async def beating() -> bool:
        info = await worker_info(nc, EDGE)
        return info is not None and info.at > restarted_at

    await eventually(beating, 30, "a new heartbeat of the edge trainer at the hub")
    await site.assert_events_once_in_order(nc, run_id)
    log.close()


async def _async(value: Any) -> Any:
    return value


async def _none(count: Any) -> bool:
    return await count == 0


async def _lapsed(js: Any, key: str) -> bool:
    return await holder(js, key) is None


async def _idle(nc: Client, worker: str) -> bool:
    info = await worker_info(nc, worker)
    return info is not None and info.run_id is None
