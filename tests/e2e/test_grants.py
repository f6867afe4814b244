"""A site keeps its trainers busy through a partition: runs granted ahead, started, leased
and completed at the site while cut off, and taken in once at heal (`shared.state.grants`).

The hub (dispatcher, checkpointer, reaper; no trainer) and the site `lab1` (leaf node in
its own domain, checkpointer, two trainers) are real processes under `baton up`'s default
authorization; a proxy cuts the leaf's link. Every stack's logs are scanned for permission
violations and JetStream API timeouts when it stops (`tests/support/audit.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from baton.client import calls as client
from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import connect, publish
from shared.contracts import JobSpec, RunRecord, RunState, decode, encode
from shared.contracts.control import Drain, Resume
from shared.contracts.events import (
    Accepted,
    CheckpointCommitted,
    Completed,
    Delegated,
    Event,
    Fenced,
    GroupFormed,
    HandedOver,
    Rejected,
    Resized,
    RunWarning,
    Started,
    TakenBack,
)
from shared.contracts.pools import units
from shared.credentials import options_for, read_env_file
from shared.ledger import book
from shared.state.drains import Drains
from shared.state.runs import Runs
from shared.state.workers import live_workers
from tests.e2e import jobs
from tests.e2e.jobs import finished, history, job, paced, submit
from tests.support.cli import as_json
from tests.support.dashboard import request, served
from tests.support.ledger import balanced, settled, topup
from tests.support.sites import Site
from tests.support.stack import Stack, attempt_processes, eventually

HUB_ONLY = ("dispatcher", "checkpointer", "reaper")
TTL = 6

pytestmark = [pytest.mark.sites, pytest.mark.timeout(420)]


PRICE = 0.01
"""Credits per trainer-second: carol's runs are charged, the operator's cost nothing."""


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    pools = tmp_path / "pools.toml"
    pools.write_text(f"[pools.default]\nprice = {{ cpu = {PRICE} }}\n")
    s = Stack(
        tmp_path / "hub", trainers=0, lease_ttl=TTL, people=("carol",),
        env={"BATON_POOLS_FILE": str(pools)},
    )  # fmt: skip
    await s.start(HUB_ONLY)
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def site(hub: Stack) -> Site:
    s = Site(hub, "lab1")
    await s.start(trainers=2)
    return s


async def records(nc: Client, run_ids: list[str]) -> list[RunRecord]:
    runs = await Runs.open(nc.jetstream())
    out = []
    for run_id in run_ids:
        found = await runs.get(run_id)
        assert found is not None, run_id
        out.append(found[0])
    return out


async def site_events(site: Site, run_id: str, kind: str) -> list[bytes]:
    """The events of `kind` the site's outbox holds for the run."""
    sent = await site.outbox(names.at_site(names.event_subject(run_id, kind), site.name))
    return [data for _, data in sent]


def of(events: list[Event], kind: type[Event]) -> list[Event]:
    return [e for e in events if isinstance(e, kind)]


async def test_a_cut_off_site_starts_and_completes_its_granted_runs(hub: Stack, site: Site) -> None:
    """Two runs training at the site and two granted ahead when the link is cut: the site
    finishes the first two, starts and commits the other two, and completes them — all
    while cut off. At heal each run is COMPLETED once at the hub, by its site's record:
    one attempt, one `completed` event, the uninterrupted run's weights. One of them is
    carol's, in a pool with a price: held at submit, metered from what the site reports
    at heal, settled once."""
    nc, carol = await hub.client(), await hub.client_as("carol")
    reference = await submit(nc, paced(60, pace=0.0))
    want = (await finished(nc, reference, timeout=90)).digest
    assert want
    topped = await topup(nc, "carol", 1.0)

    run_ids = [await submit(nc, paced(60, pace=0.08)) for _ in range(3)]
    run_ids.append(await submit(carol, paced(60, pace=0.08, name="carols", estimate_s=30)))

    async def granted() -> bool:
        return all(r.site == "lab1" for r in await records(nc, run_ids))

    await eventually(granted, 30, "the four runs to be granted to lab1")

    async def two_started() -> list[str] | None:
        rs = await records(nc, run_ids)
        running = [r.run_id for r in rs if r.state is RunState.RUNNING]
        return running if len(running) == 2 else None

    running = await eventually(two_started, 60, "two runs to start at the site")
    queued = [r for r in run_ids if r not in running]
    site.proxy.sever()
    # The hub's view, frozen by the cut: lab1 holds the four runs.
    [view] = await as_json(hub, "sites")
    assert view["site"] == "lab1" and view["held"] == 4, view

    async def done_at_site() -> bool:
        return all([await site_events(site, r, "completed") for r in run_ids])

    await eventually(done_at_site, 240, "every run to complete at the cut-off site")
    # The queued ones started at the site during the cut: their `started` and commits
    # are in the site's outbox, and the hub has not heard of them yet.
    for run_id in queued:
        assert await site_events(site, run_id, "started"), run_id
        assert await site_events(site, run_id, "checkpoint_committed"), run_id
        assert not [e for e in await history(nc, run_id) if isinstance(e, Started)], run_id
    await _site_shows_its_own(site, run_ids)
    site.proxy.restore()

    for run_id in run_ids:
        record = await finished(nc, run_id, timeout=60)
        assert record.state is RunState.COMPLETED and record.digest == want, record
        assert record.attempts == 1, f"{run_id} trained again: {record.attempts} attempts"

    for run_id in run_ids:
        await eventually(
            lambda r=run_id: _completed_once(nc, r), 30, f"{run_id}'s events at the hub"
        )
        events = await history(nc, run_id)
        assert len(of(events, Started)) == 1 and not of(events, Fenced)
        [grant] = of(events, Delegated)
        assert isinstance(grant, Delegated) and grant.site == "lab1"
        await site.assert_events_once_in_order(nc, run_id)
    await balanced(nc, "carol", run_ids[3], topped, PRICE)


@contextlib.asynccontextmanager
async def lab1_and_spare(tmp_path: Path) -> AsyncIterator[tuple[Stack, Site, Site]]:
    """The hub's services (no trainer), lab1 with one trainer, and lab2, for a test to start
    once a run taken back from lab1 is to go somewhere; stopped however the test ends."""
    hub = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL)
    await hub.start(HUB_ONLY)
    try:
        lab1, lab2 = Site(hub, "lab1"), Site(hub, "lab2")
        await lab1.start(trainers=1)
        yield hub, lab1, lab2
    finally:
        await hub.stop()


async def test_a_site_silent_past_lost_after_loses_its_runs_to_another(
    tmp_path: Path,
) -> None:
    """lab1 holds a run and falls silent past the job's `lost_after`: the hub takes the run
    back (fencing lab1's grant in the store) and lab2 completes it. At heal lab1's commits
    for it are refused, its process is stopped with a `fenced` event saying why, and the
    run completes once, with the uninterrupted run's weights."""
    async with lab1_and_spare(tmp_path) as (hub, lab1, lab2):
        nc = await hub.client()
        reference = await submit(nc, paced(400, pace=0.0))
        want = (await finished(nc, reference, timeout=90)).digest

        # Long enough that lab1 is still training when the hub takes the run back.
        spec = paced(400, pace=0.08, disconnect={"lost_after_s": 8})
        run_id = await submit(nc, spec)

        async def committed_at_lab1() -> bool:
            return len(await site_events(lab1, run_id, "checkpoint_committed")) >= 2

        await eventually(committed_at_lab1, 60, "the run to commit at lab1")
        lab1.proxy.sever()
        await lab2.start(trainers=1)

        async def taken_back() -> TakenBack | None:
            found = of(await history(nc, run_id), TakenBack)
            return found[0] if found else None  # type: ignore[return-value]

        back = await eventually(taken_back, 60, "the hub to take the run back from lab1")
        assert back.site == "lab1" and "silent" in back.reason, back
        record = await finished(nc, run_id, timeout=180)
        assert record.state is RunState.COMPLETED and record.digest == want, record
        last = of(await history(nc, run_id), Started)[-1]
        assert isinstance(last, Started) and last.worker == "lab2-trainer-1", last

        lab1.proxy.restore()
        await lab1.linked()

        async def lab1_fenced() -> Fenced | None:
            found = [decode(d, Fenced) for d in await site_events(lab1, run_id, "fenced")]
            return found[0] if found else None

        fenced = await eventually(lab1_fenced, 60, "lab1's copy to be fenced")
        # Stopped by the store refusing a commit, or by the hub's answer at heal, whichever
        # came first.
        assert any(w in fenced.reason for w in ("refused", "took the run back", "latest names"))
        events = await history(nc, run_id)
        assert len(of(events, Completed)) == 1, [type(e).__name__ for e in events]
        final = (await records(nc, [run_id]))[0]
        assert final.state is RunState.COMPLETED and final.site != "lab1", final


async def test_a_site_that_finishes_a_run_taken_back_before_its_first_checkpoint_is_fenced(
    tmp_path: Path,
) -> None:
    """lab1 falls silent past `lost_after` while training a run that has committed nothing
    yet (it checkpoints only at its end), and trains on through the cut to its end. The hub
    took the run back meanwhile: `latest` became a fence alone at the new epoch, so lab1's
    final commit is refused, and lab2's replacement completes the run — one `completed`,
    lab2's. Seen before: with no checkpoint to move, nothing was fenced in the store, and
    both sites completed the run."""
    async with lab1_and_spare(tmp_path) as (hub, lab1, lab2):
        nc = await hub.client()
        spec = paced(
            400, pace=0.08, disconnect={"lost_after_s": 8}, checkpoint={"every_steps": 100_000}
        )
        run_id = await submit(nc, spec)
        await eventually(lambda: _started_at(nc, run_id, "lab1"), 60, "the run to start at lab1")
        lab1.proxy.sever()

        async def taken_back() -> bool:
            return bool(of(await history(nc, run_id), TakenBack))

        await eventually(taken_back, 60, "the hub to take the run back from lab1")
        assert not await site_events(lab1, run_id, "checkpoint_committed"), "too late a cut"

        async def over_at_lab1() -> list[str]:
            ends = ("completed", "fenced", "attempt_failed")
            return [k for k in ends if await site_events(lab1, run_id, k)]

        ended = await eventually(over_at_lab1, 120, "lab1 to reach the run's end")
        assert ended == ["fenced"], f"lab1's attempt ended with {ended}"
        fenced = decode((await site_events(lab1, run_id, "fenced"))[0], Fenced)
        assert "refused" in fenced.reason or "latest names" in fenced.reason, fenced
        await lab2.start(trainers=1)
        record = await finished(nc, run_id, timeout=180)
        assert record.state is RunState.COMPLETED and record.site != "lab1", record
        lab1.proxy.restore()
        await lab1.linked()
        await eventually(lambda: _completed_once(nc, run_id), 30, "the run's events at the hub")
        events = await history(nc, run_id)
        done = of(events, Completed)
        assert len(done) == 1, [type(e).__name__ for e in events]
        last = of(events, Started)[-1]
        assert isinstance(last, Started) and last.worker == "lab2-trainer-1", last


async def test_jobs_submitted_at_a_cut_off_site_start_there_and_are_one_run_each(
    hub: Stack, site: Site
) -> None:
    """During a cut the site's own dispatcher takes jobs submitted there and its trainers
    run them; the same job also submitted at the hub meanwhile is still one run at heal."""
    nc, at_site = await hub.client(), await site.client("submitter")
    reference = await submit(nc, paced(40, pace=0.0))
    want = (await finished(nc, reference, timeout=90)).digest
    used = await _used_at_the_hub_alone(hub, site)
    site.proxy.sever()
    await eventually(lambda: _down(nc, "lab1"), 30, "the hub to see lab1 cut off")
    # A job whose id the hub used before the cut, submitted again at the site: answered as
    # the hub would (a duplicate), from the site's copy of the hub's records; never run.
    at_site_operator = await site.client()
    again_id, answer = await client.submit(at_site_operator, used.spec, 20, "lab1")
    assert again_id == used.run_id and isinstance(answer, Accepted) and answer.duplicate, answer
    specs = [paced(40, pace=0.02) for _ in range(3)]
    run_ids = []
    for spec in specs:
        run_id, answer = await client.submit(at_site, spec, 20, "lab1")
        assert isinstance(answer, Accepted) and not answer.duplicate, answer
        run_ids.append(run_id)
    # The same job twice at the site: the same run (started and completed once, below).
    again, answer = await client.submit(at_site, specs[1], 20, "lab1")
    assert again == run_ids[1] and isinstance(answer, Accepted), answer
    # Bad input at the site: a clear answer, nothing run.
    _, answer = await client.submit(at_site, paced(40, pool="nope"), 20, "lab1")
    assert isinstance(answer, Rejected) and "no trainer of pool 'nope'" in answer.reason, answer
    # The first job again, at the hub, by the same submitter (the operator may publish on
    # its subject): the hub has a record of it too now, queued — it has no trainer, and
    # lab1 is cut off. The pool has a price: the hub's copy holds the submitter's credits,
    # which the run — the site's — settles once it ends.
    topped = await topup(nc, "lab1-submitter", 1.0)
    await publish(
        nc.jetstream(), names.submit_subject("default", "lab1-submitter"), encode(specs[0]),
        msg_id=f"hub-copy-{run_ids[0]}",
    )  # fmt: skip
    at_hub = await eventually(lambda: _record(nc, run_ids[0]), 30, "the hub's copy")
    assert at_hub.state is RunState.QUEUED and at_hub.attempts == 0, at_hub

    async def done_at_site() -> bool:
        return all([await site_events(site, r, "completed") for r in run_ids])

    await eventually(done_at_site, 180, "the site's jobs to complete during the cut")
    site.proxy.restore()
    for run_id in run_ids:
        assert run_id.startswith("lab1-submitter."), run_id
        record = await finished(nc, run_id, timeout=60)
        assert record.state is RunState.COMPLETED and record.digest == want, record
        assert record.attempts == 1 and record.site == "lab1", record

    async def heard() -> bool:
        return all([of(await history(nc, r), Completed) for r in run_ids])

    await eventually(heard, 30, "the site's events at the hub")
    for run_id in run_ids:
        events = await history(nc, run_id)
        kinds = [type(e).__name__ for e in events]
        assert kinds.count("Completed") == 1 and kinds.count("Started") == 1, kinds
    # The jobs submitted at the site alone held nothing (the site cannot read the ledger
    # while cut off): priced as the hub took them in, and charged their events.
    alone = [await settled(nc, "lab1-submitter", run_id) for run_id in run_ids[1:]]
    for settle in alone:
        assert settle.held == 0 and settle.charged > 0, settle
        assert settle.charged == units((settle.productive_s + settle.failed_s) * PRICE), settle
    # The hub's copy's hold went with the run, and is settled once.
    others = sum(s.charged for s in alone)
    await balanced(nc, "lab1-submitter", run_ids[0], topped - others, PRICE)
    # The job the hub used before: still its cancelled run, started nowhere.
    [record] = await records(nc, [used.run_id])
    assert record.state is RunState.CANCELLED and record.attempts == 0, record
    at_lab1 = await Runs.open(at_site_operator.jetstream(), bucket=LAB1_RUNS)
    assert await at_lab1.get(used.run_id) is None
    assert not await site_events(site, used.run_id, "started")


LAB1_RUNS = names.site_runs_bucket("lab1")


async def _used_at_the_hub_alone(hub: Stack, site: Site) -> RunRecord:
    """A run the hub queued and cancelled while lab1's trainers were drained (so never
    granted to lab1), once lab1's copy of the hub's records holds it cancelled."""
    nc = await hub.client()
    drains = Drains(nc.jetstream())
    for worker in site.trainers:
        await drains.drain(Drain(worker=worker, reason="test", at=time.time()))

    async def drained(want: bool) -> bool:  # as the scheduler reads it: in the heartbeats
        live = {w.worker: w.drained for w in await live_workers(nc.jetstream())}
        return all(live.get(worker) is want for worker in site.trainers)

    await eventually(lambda: drained(True), 30, "lab1's trainers drained at the hub")
    run_id = await submit(nc, paced(40, pace=0.0))

    async def passed_over() -> bool:  # a scheduler pass saw it and granted it nowhere
        record = await _record(nc, run_id)
        return record is not None and record.waiting is not None and not record.site

    await eventually(passed_over, 30, "the scheduler to leave the run queued")
    await client.cancel(nc, run_id, "test")
    for worker in site.trainers:
        await drains.undrain(worker)
    await eventually(lambda: drained(False), 30, "lab1's trainers undrained")
    copy = (await site.client()).jetstream()

    async def copied() -> RunRecord | None:
        subject = f"$KV.{names.RUNS_BUCKET}.{run_id}"
        with contextlib.suppress(Exception):
            msg = await copy.get_last_msg(names.HUB_RUNS_STREAM, subject, direct=True)
            record = decode(msg.data, RunRecord)
            return record if record.state is RunState.CANCELLED else None
        return None

    return await eventually(copied, 30, "lab1's copy of the hub's records to hold the run")


async def test_a_site_trainer_killed_and_its_server_restarted_during_the_cut(
    hub: Stack, site: Site
) -> None:
    """SIGKILL of a site trainer mid-run and a restart of the site's nats-server (same
    disk), both during the cut: every granted run completes once, none is lost, and the
    killed one resumes from its last checkpoint. The runs are user-shaped: the character
    model with a shuffling `ctx.data_loader`, AdamW, a cosine schedule, dropout."""
    nc = await hub.client()
    reference = await submit(nc, charlm(160, pace=0.0))
    want = (await finished(nc, reference, timeout=90)).digest
    await site.add_trainer("lab1-trainer-3", restart=True)
    await site.linked()
    run_ids = [await submit(nc, charlm(160, pace=0.06)) for _ in range(4)]

    async def victim_training() -> RunRecord | None:
        """All four granted, and one trained by the trainer to be killed (on a loaded
        machine the first runs may be done before it starts one: it takes the next)."""
        rs = await records(nc, run_ids)
        mine = [r for r in rs if r.state is RunState.RUNNING and r.worker == "lab1-trainer-3"]
        return mine[0] if mine and all(r.site for r in rs) else None

    victim = await eventually(victim_training, 120, "a granted run to train on lab1-trainer-3")
    site.proxy.sever()

    async def committed() -> bool:
        return bool(await site_events(site, victim.run_id, "checkpoint_committed"))

    await eventually(committed, 60, "a checkpoint of the victim's run")
    os.kill(hub.pid("lab1-trainer-3"), signal.SIGKILL)
    await site.nats.restart(kill=True)

    async def handed_over() -> HandedOver | None:
        sent = await site_events(site, victim.run_id, "handed_over")
        return decode(sent[0], HandedOver) if sent else None

    # Its restart, still cut off, finds the claim and hands the run over at once.
    handed = await eventually(handed_over, 60, "the restarted trainer to hand the run over")
    assert "successor" in handed.reason, handed

    async def done_at_site() -> bool:
        return all([await site_events(site, r, "completed") for r in run_ids])

    await eventually(done_at_site, 240, "every granted run to complete during the cut")
    site.proxy.restore()
    for run_id in run_ids:
        record = await finished(nc, run_id, timeout=60)
        assert record.state is RunState.COMPLETED and record.digest == want, record
    for run_id in run_ids:
        await eventually(
            lambda r=run_id: _completed_once(nc, r), 30, f"{run_id}'s events at the hub"
        )
    # The site's events reach the hub in its order: with `completed` there, so is all before.
    starts = of(await history(nc, victim.run_id), Started)
    assert len(starts) == 2 and starts[1].start_step > 0, starts  # type: ignore[attr-defined]


async def test_a_granted_run_is_timed_at_the_hub_and_stopped_at_its_site(
    hub: Stack, site: Site
) -> None:
    """A run granted to the site, with a soft and a hard timeout: the hub warns of the first
    and ends the run at the second, as it does a run of its own, and the site's trainer
    stops training it at its next look at the grant. Seen before: the hub skipped granted
    runs' timeouts and budgets, and the site kept training past them."""
    nc = await hub.client()
    limits = {"soft_timeout_s": 4, "hard_timeout_s": 10}
    run_id = await submit(nc, paced(100_000, pace=0.05, limits=limits))
    await eventually(lambda: _started_at(nc, run_id, "lab1"), 60, "the run to start at the site")
    record = await finished(nc, run_id, timeout=90)
    assert record.state is RunState.FAILED and record.site == "lab1", record
    assert (record.reason or "").startswith("hard_timeout"), record.reason
    events = await history(nc, run_id)
    assert [e.kind for e in of(events, RunWarning)] == ["soft_timeout"], events
    site_runs = await Runs.open(
        (await site.client()).jetstream(), bucket=names.site_runs_bucket("lab1")
    )

    async def stopped_at_site() -> bool:
        found = await site_runs.get(run_id)
        return found is not None and found[0].state is RunState.FAILED

    await eventually(stopped_at_site, 60, "the site's record to end as the hub's did")
    trainers = [hub.pid(name) for name in site.trainers]
    await eventually(lambda: _idle(trainers), 60, "the site's trainers to stop training it")
    assert not await site_events(site, run_id, "completed")


async def test_a_granted_run_cancelled_before_its_site_starts_it_ends_at_once(
    hub: Stack, site: Site
) -> None:
    """Both of lab1's trainers train long runs and a third is granted to lab1 ahead, queued
    there. Cancelled at the hub, it is the hub's to end at once: taken back (fenced in the
    store) and CANCELLED while both trainers still train — not left to a site trainer that
    may never take it (the fault campaign saw a grant sent as a link healed never reach its
    site, and the cancelled run waited for ever)."""
    nc = await hub.client()
    busy = [await submit(nc, paced(100_000, pace=0.05)) for _ in range(2)]
    ahead = await submit(nc, paced(40, pace=0.0))

    async def granted() -> bool:
        rs = await records(nc, [*busy, ahead])
        return all(r.site == "lab1" for r in rs) and all(
            r.state is RunState.RUNNING for r in rs[:2]
        )

    await eventually(granted, 60, "two runs training at lab1 and a third granted ahead")
    await client.cancel(nc, ahead, "not needed")
    ended = await finished(nc, ahead, timeout=60)
    assert ended.state is RunState.CANCELLED and not ended.site, ended
    assert all(r.state is RunState.RUNNING for r in await records(nc, busy)), "a trainer freed"
    events = await history(nc, ahead)
    assert [e.site for e in of(events, TakenBack) if isinstance(e, TakenBack)] == ["lab1"]
    assert not of(events, Started), "started after its cancel"
    for run_id in busy:
        await client.cancel(nc, run_id, "the test is over")
    for run_id in busy:
        assert (await finished(nc, run_id, timeout=90)).state is RunState.CANCELLED


async def test_a_run_the_hub_ends_during_a_cut_is_settled_with_what_its_site_trained(
    hub: Stack, site: Site
) -> None:
    """carol's run, granted to lab1 and training there when the link is cut, is ended at
    the hub by its hard timeout during the cut. Its settlement waits for what the site
    trained through the cut — its events, sourced at heal — and then charges every one of
    them, once. Seen before: it was settled at once from the hub's events alone, and the
    site's training through the cut cost nothing."""
    nc, carol = await hub.client(), await hub.client_as("carol")
    topped = await topup(nc, "carol", 2.0)
    limits = {"hard_timeout_s": 20}
    spec = paced(100_000, pace=0.05, name="timed-out", estimate_s=60, limits=limits)
    run_id = await submit(carol, spec)
    await eventually(lambda: _started_at(nc, run_id, "lab1"), 60, "the run to start at the site")
    # A run of three ranks no site of two trainers is granted, and no hub trainer takes:
    # cancelled while queued, it is settled at once — a mark that the reaper's billing has
    # passed the runs it could settle.
    mark = await submit(carol, paced(10, name="mark", estimate_s=5, ranks=3))
    site.proxy.sever()
    try:
        ended = await finished(nc, run_id, timeout=90)
        assert ended.state is RunState.FAILED and ended.site == "lab1", ended
        assert (ended.reason or "").startswith("hard_timeout"), ended.reason
        await client.cancel(carol, mark, "a mark", "")
        await settled(nc, "carol", mark)
        assert not (await _record(nc, run_id) or ended).settled, "settled without the site"
        subject = names.ledger_subject("carol", "settle", run_id)
        assert await book.find(nc.jetstream(), subject) is None
    finally:
        site.proxy.restore()
    settle = await balanced(nc, "carol", run_id, topped, PRICE)
    assert settle.productive_s > 0, settle


async def test_an_owner_past_the_overdraft_has_the_runs_nothing_held_for_paused(
    hub: Stack, site: Site
) -> None:
    """lab1's submitter, its balance 0 and the pool's overdraft 0, submits two jobs at lab1
    while it is cut off: nothing can be held for them. The short one completes during the
    cut; at heal the hub takes both in, priced, and charges the short one, which leaves the
    balance below zero — so the long one, still training at lab1 on credit, is paused at
    its next checkpoint (`budget: …`; a `credits_overdrawn` warning says why), losing no
    step. After a top-up, `baton resume` holds what it still needs, and it completes with
    the uninterrupted run's weights, charged what it trained, to the unit. The jobs are a
    user's: the character model with its shuffling data loader, AdamW and a cosine
    schedule (`examples/charlm.py`)."""
    nc, at_site = await hub.client(), await site.client("submitter")
    reference = await submit(nc, charlm(200, pace=0.0))
    want = (await finished(nc, reference, timeout=90)).digest
    site.proxy.sever()
    await eventually(lambda: _down(nc, "lab1"), 30, "the hub to see lab1 cut off")
    short, _ = await client.submit(at_site, charlm(40, pace=0.0), 20, "lab1")
    long, _ = await client.submit(at_site, charlm(200, pace=0.2), 20, "lab1")

    async def short_done() -> bool:
        return bool(await site_events(site, short, "completed"))

    await eventually(short_done, 90, "the short job to complete at the cut-off site")
    site.proxy.restore()
    charged = (await settled(nc, "lab1-submitter", short)).charged
    assert charged > 0

    async def paused() -> RunRecord | None:
        found = await _record(nc, long)
        return found if found is not None and found.state is RunState.PAUSED else None

    stopped = await eventually(paused, 90, "the long job to pause past the overdraft")
    why = stopped.pause_requested or ""
    assert why.startswith("budget: lab1-submitter's balance is -"), stopped
    assert "overdraft of 0 pool default allows" in why and stopped.step < 400, stopped
    warned = [e for e in of(await history(nc, long), RunWarning) if isinstance(e, RunWarning)]
    assert [w.kind for w in warned] == ["credits_overdrawn"], warned
    # Said where people look: `baton credits` and the dashboard (as its own role).
    account = await as_json(hub, "credits", "--owner", "lab1-submitter")
    assert account["overdrawn"] and account["balance_units"] == -charged, account
    creds = options_for(read_env_file(hub.root / "auth" / "dashboard.env"))
    dashboard = await connect(hub.hub.url, "dashboard", first_attempt_timeout=10, options=creds)
    hub.clients.append(dashboard)  # closed when the stack stops
    async with served(dashboard, hub.store_url) as url:
        shown = (await request(url, "/api/queue?pool=default")).json()["credits"]
    assert shown["lab1-submitter"]["overdrawn"] is True, shown
    # Short of credits, a resume is refused, nothing held; after a top-up it holds and
    # goes on from the pause's checkpoint.
    await client.steer(nc, Resume(run_id=long))

    async def refused() -> str | None:
        said = [e for e in await history(nc, long) if isinstance(e, RunWarning)]
        return next((w.detail for w in said if w.kind == "resume_refused"), None)

    assert "short" in await eventually(refused, 60, "the resume to be refused")
    assert (await _record(nc, long) or stopped).state is RunState.PAUSED
    topped = await topup(nc, "lab1-submitter", 10.0)
    await client.steer(nc, Resume(run_id=long))
    done = await finished(nc, long, timeout=120)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    await balanced(nc, "lab1-submitter", long, topped - charged, PRICE)


async def test_a_group_granted_to_a_site_or_submitted_there_trains_through_a_cut(
    hub: Stack, site: Site
) -> None:
    """A 2-rank DDP job (`examples/ddp.py`, gloo) is granted to lab1, whose two trainers
    are free: its group forms at the site (the site's groups bucket, its calls in the
    site's work queue), the link is cut mid-run, and the group trains on and completes
    there. At heal the run is COMPLETED once at the hub, with the uninterrupted run's
    weights, its group's events and its one `completed` sourced from the site. Then the
    same job is submitted at lab1 while it is cut off: the site has the two ranks, so it
    trains there and ends exact; one of three ranks is refused, saying why."""
    nc = await hub.client()
    reference = await submit(nc, ddp2(60, pace=0.0))
    record = await finished(nc, reference, timeout=120)
    assert record.state is RunState.COMPLETED and record.site == "lab1", record
    run_id = await submit(nc, ddp2(60, pace=0.08))

    async def committed_at_site() -> bool:
        return bool(await site_events(site, run_id, "checkpoint_committed"))

    await eventually(committed_at_site, 90, "the group to commit a checkpoint at lab1")
    site.proxy.sever()
    assert not await site_events(site, run_id, "completed"), "done before the cut"

    await _group_done_at_site_once(nc, site, run_id, record.digest)

    site.proxy.sever()
    await eventually(lambda: _down(nc, "lab1"), 30, "the hub to see lab1 cut off")
    at_site = await site.client("submitter")
    own, answer = await client.submit(at_site, ddp2(60, pace=0.02), 20, "lab1")
    assert isinstance(answer, Accepted) and answer.unconfirmed, answer
    _, answer = await client.submit(at_site, job(name="ddp", entry_point="examples.ddp:train",
                                                 total_steps=20, ranks=3), 20, "lab1")  # fmt: skip
    assert isinstance(answer, Rejected) and "site lab1 has 2" in answer.reason, answer

    await _group_done_at_site_once(nc, site, own, record.digest)


async def _group_done_at_site_once(nc: Client, site: Site, run_id: str, want: str | None) -> None:
    """The group of `run_id` completes at the cut-off site; the link heals, and the run is
    COMPLETED once at the hub with `want`'s weights, by the site's record (one attempt, its
    group of the site's two trainers), each of its site events arriving once, in order."""

    async def done_at_site() -> bool:
        return bool(await site_events(site, run_id, "completed"))

    await eventually(done_at_site, 120, "the group to complete at the cut-off site")
    site.proxy.restore()
    done = await finished(nc, run_id, timeout=60)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    assert done.site == "lab1" and done.attempts == 1, done
    await eventually(lambda: _completed_once(nc, run_id), 30, "the run's events at the hub")
    [formed] = of(await history(nc, run_id), GroupFormed)
    assert isinstance(formed, GroupFormed) and set(formed.members) == set(site.trainers), formed
    await site.assert_events_once_in_order(nc, run_id)


async def test_an_elastic_run_granted_to_a_site_shrinks_and_grows_there_through_a_cut(
    hub: Stack, site: Site
) -> None:
    """An elastic run (`examples/elastic.py`, 1 to 2 ranks) is granted to lab1 and forms
    there on both of its trainers; the link is cut, and during the cut one of them is
    SIGKILLed for good: the group shrinks to one rank at the site, from its last commit, and
    once a new trainer joins the site it grows back to two — all while cut off. At heal the
    run is COMPLETED once at the hub, on the bits of an uninterrupted run, each of its site
    events arriving once, in order."""
    nc = await hub.client()

    def elastic(ranks: object, pace: float) -> JobSpec:
        return job(
            name="elastic", entry_point="examples.elastic:train", total_steps=300, ranks=ranks,
            seed=5, checkpoint={"every_steps": 10},
            config={"shards": 2, "samples": 512, "steps_sleep": pace},
        )  # fmt: skip

    reference = await submit(nc, elastic(1, 0.0))
    want = (await finished(nc, reference, timeout=120)).digest
    assert want
    run_id = await submit(nc, elastic({"min": 1, "max": 2}, 0.05))

    async def at_site(kind: type[Event], tag: str, ok: Callable[[Any], bool]) -> Any:
        found = [decode(d, kind) for d in await site_events(site, run_id, tag)]
        return next((e for e in found if ok(e)), None)

    formed = await eventually(
        lambda: at_site(GroupFormed, "group_formed", lambda e: len(e.members) == 2),
        90, "a group of two at lab1",
    )  # fmt: skip
    assert (await records(nc, [run_id]))[0].site == "lab1"
    await eventually(
        lambda: at_site(CheckpointCommitted, "checkpoint_committed",
                        lambda e: e.token == formed.epoch),
        60, "a commit",
    )  # fmt: skip
    site.proxy.sever()
    hub.signal(formed.members[1], signal.SIGKILL)  # rank 1's trainer, for good
    shrunk = await eventually(
        lambda: at_site(Resized, "resized", lambda e: e.to_ranks == 1),
        90, "the group to shrink at lab1",
    )  # fmt: skip
    await site.add_trainer(f"{site.name}-trainer-3")
    grown = await eventually(
        lambda: at_site(Resized, "resized", lambda e: e.to_ranks == 2 and e.epoch > shrunk.epoch),
        120, "the group to grow back at lab1",
    )  # fmt: skip
    assert grown.from_ranks == 1, grown

    async def done_at_site() -> bool:
        return bool(await site_events(site, run_id, "completed"))

    await eventually(done_at_site, 180, "the run to complete at the cut-off site")
    assert not [e for e in await history(nc, run_id) if isinstance(e, Resized)], "heard in a cut"
    site.proxy.restore()
    done = await finished(nc, run_id, timeout=60)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    assert done.site == "lab1", done
    await eventually(lambda: _completed_once(nc, run_id), 30, "the run's events at the hub")
    await site.assert_events_once_in_order(nc, run_id)


def ddp2(total: int, pace: float) -> JobSpec:
    """Two ranks of the DDP example, a checkpoint every 10 steps; `pace` changes no
    arithmetic."""
    return job(
        name="ddp", entry_point="examples.ddp:train", total_steps=total, ranks=2, seed=11,
        checkpoint={"every_steps": 10}, config={"steps_sleep": pace},
    )  # fmt: skip


async def _started_at(nc: Client, run_id: str, at: str) -> bool:
    found = await _record(nc, run_id)
    return found is not None and found.site == at and found.state is RunState.RUNNING


async def _idle(trainers: list[int]) -> bool:
    return all(not attempt_processes(pid) for pid in trainers)


async def _site_shows_its_own(site: Site, run_ids: list[str]) -> None:
    """The CLI at the cut-off site answers from the site's own state: its runs (done
    there), its trainers, a run's status; and says in one line what it leaves out."""
    code, out, err = await site.cli("runs", "--json")
    assert code == 0 and "Traceback" not in err, (code, out, err)
    shown = {r["run_id"]: r for r in json.loads(out)}
    for run_id in run_ids:
        assert shown[run_id]["state"] == "COMPLETED" and shown[run_id]["site"] == "lab1", shown
    assert "the hub is unreachable from this site" in err, err
    code, out, err = await site.cli("workers", "--json")
    assert code == 0, (code, out, err)
    assert {w["worker"] for w in json.loads(out)} == {"lab1-trainer-1", "lab1-trainer-2"}, out
    code, out, err = await site.cli("status", run_ids[-1])
    assert code == 0 and "COMPLETED" in out and "Traceback" not in err, (code, out, err)


def charlm(total: int, pace: float) -> JobSpec:
    return jobs.charlm(total, pace, name="charlm-site", seed=23, every=20)


async def _down(nc: Client, site: str) -> bool:
    return site not in await sites.linked(nc)


async def _record(nc: Client, run_id: str) -> RunRecord | None:
    found = await (await Runs.open(nc.jetstream())).get(run_id)
    return found[0] if found is not None else None


async def _completed_once(nc: Client, run_id: str) -> bool:
    found = of(await history(nc, run_id), Completed)
    assert len(found) <= 1, f"{run_id} completed {len(found)} times"
    return len(found) == 1


@pytest.mark.operations  # an operator's drain, in that tier with the other drain tests
async def test_grants_a_drained_site_cannot_start_go_back_to_the_hub(tmp_path: Path) -> None:
    """lab1 is linked, but its only trainer is drained: the run it trained is handed back
    at its checkpoint and the one granted ahead never starts there. Past `lost_after` both
    are taken back, and the hub's trainer completes them."""
    hub = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL)
    await hub.start(HUB_ONLY)
    try:
        lab1 = Site(hub, "lab1")
        await lab1.start(trainers=1)
        nc = await hub.client()
        spec = {"disconnect": {"lost_after_s": 3}}
        run_ids = [await submit(nc, paced(400, pace=0.05, **spec)) for _ in range(2)]

        async def held() -> bool:
            rs = await records(nc, run_ids)
            return all(r.site == "lab1" for r in rs) and any(r.step > 0 for r in rs)

        await eventually(held, 60, "both granted to lab1, one committing there")
        drain = Drain(worker="lab1-trainer-1", reason="test", at=time.time())
        await Drains(nc.jetstream()).drain(drain)
        await hub.add_trainer("hub-trainer-1")
        for run_id in run_ids:
            record = await finished(nc, run_id, timeout=180)
            assert record.state is RunState.COMPLETED and not record.site, record
            events = await history(nc, run_id)
            [back] = of(events, TakenBack)
            assert "without a trainer of pool default" in back.reason, back  # type: ignore[attr-defined]
            last = of(events, Started)[-1]
            assert last.worker == "hub-trainer-1", last  # type: ignore[attr-defined]
            assert len(of(events, Completed)) == 1
    finally:
        await hub.stop()
