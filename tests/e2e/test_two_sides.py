"""One job accepted at the hub and at a cut-off site: the store's chain decides which side's
run counts, the other side's attempt stops, and the run completes once
(`shared.state.owner`).

The hub (dispatcher, checkpointer, reaper, one trainer) and the site `lab1` (leaf node,
checkpointer, one trainer) are real processes under `baton up`'s default authorization and
share one checkpoint store; a proxy cuts the leaf's link. The job is a user's: a character
model with a shuffling data loader, AdamW and a cosine schedule (`examples/charlm.py`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from baton.client import calls as client
from shared.bus import names
from shared.bus import sourcing as sources
from shared.bus.connect import publish
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState, encode
from shared.contracts.events import Accepted, Completed, Event, Started, Superseded
from shared.contracts.records import run_id_for
from shared.state import grants
from shared.state.runs import Runs
from tests.e2e import jobs
from tests.e2e.jobs import finished, history
from tests.support.sites import Site
from tests.support.stack import Stack, eventually
from tests.support.verify import no_violation

TTL = 6
SUBMITTER = "lab1-submitter"
"""The same owner at both sides: the same key makes the same run id."""

pytestmark = [pytest.mark.adversary, pytest.mark.timeout(420)]


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "hub", trainers=1, lease_ttl=TTL)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


@pytest.fixture
async def site(hub: Stack) -> Site:
    s = Site(hub, "lab1")
    await s.start(trainers=1)
    return s


def charlm(pace: float, key: str) -> JobSpec:
    spec = jobs.charlm(120, pace, name="two-sides", seed=5, every=20)
    return msgspec.structs.replace(spec, idempotency_key=key)


async def at_hub(nc: Client, spec: JobSpec) -> None:
    """Submit `spec` at the hub as lab1's submitter would (the operator may publish on any
    submitter's subject)."""
    subject = names.submit_subject(spec.pool, SUBMITTER)
    await publish(nc.jetstream(), subject, encode(spec), msg_id=f"hub-{spec.idempotency_key}")


async def at_site(nc: Client, spec: JobSpec) -> str:
    run_id, answer = await client.submit(nc, spec, 20, "lab1")
    assert isinstance(answer, Accepted) and not answer.duplicate, answer
    assert answer.unconfirmed, "accepted while cut off, the site must say it could not ask"
    return run_id


async def record(nc: Client, run_id: str) -> RunRecord | None:
    found = await (await Runs.open(nc.jetstream())).get(run_id)
    return found[0] if found else None


async def site_said(site: Site, run_id: str, kind: str) -> bool:
    return bool(await site.outbox(names.at_site(names.event_subject(run_id, kind), "lab1")))


def of(events: list[Event], kind: type[Event]) -> list[Event]:
    return [e for e in events if isinstance(e, kind)]


async def test_the_same_job_at_both_sides_of_a_cut_completes_once(hub: Stack, site: Site) -> None:
    async with contextlib.AsyncExitStack() as stack_store:
        await _both_sides(hub, site, stack_store)
    await no_violation(hub)


async def _both_sides(hub: Stack, site: Site, stack_store: contextlib.AsyncExitStack) -> None:
    nc = await hub.client()
    at_lab1 = await site.client("submitter")
    reference = await jobs.submit(nc, charlm(0.0, uuid.uuid4().hex))
    want = (await finished(nc, reference, timeout=120)).digest
    assert want
    site.proxy.sever()

    async def down() -> bool:  # else the hub would grant the hub's copy to lab1
        return "lab1" not in await sources.linked(nc)

    await eventually(down, 30, "the hub to see lab1 cut off")
    store = await stack_store.enter_async_context(open_store(hub.store_url))

    # 1. Both sides train it; the site, under its own higher epoch, takes the store's chain
    #    with its first commit, and the hub's final commit is refused: the hub's attempt
    #    stops and its record follows the store (no redelivery loop), the site completes it.
    key = uuid.uuid4().hex
    first = charlm(0.1, key)
    run_id = run_id_for(key, SUBMITTER)
    await at_hub(nc, first)

    async def started_at_hub() -> bool:
        r = await record(nc, run_id)
        return r is not None and r.state is RunState.RUNNING and not r.site

    await eventually(started_at_hub, 60, "the hub's attempt to start")
    assert await at_site(at_lab1, first) == run_id

    async def yielded() -> RunRecord | None:
        r = await record(nc, run_id)
        return r if r is not None and r.site == "lab1" else None

    moved = await eventually(yielded, 180, "the hub's record to follow the store")
    assert moved.epoch == grants.site_epoch("lab1") and moved.worker is None, moved
    await eventually(lambda: site_said(site, run_id, "completed"), 180, "lab1 to complete it")
    latest = await commit.read_latest(store, run_id)
    assert latest is not None and latest[0].final and latest[0].site == "lab1", latest
    # The site's tokens are of its own epoch, which no other side issues (a hub's grant of
    # the same run to another site counts 1, 2, …).
    assert latest[0].epoch == grants.site_epoch("lab1") > 1, latest

    # 2. The hub trains a job to its end during the cut; the same job submitted at the
    #    site afterwards (its copy of the hub's records cannot know it) is not trained
    #    there: the store's chain ends in the hub's final commit.
    key = uuid.uuid4().hex
    second = charlm(0.0, key)
    other = run_id_for(key, SUBMITTER)
    await at_hub(nc, second)
    done = await finished(nc, other, timeout=120)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    assert await at_site(at_lab1, second) == other
    await eventually(lambda: site_said(site, other, "superseded"), 60, "lab1 to give way")
    assert not await site_said(site, other, "started"), "lab1 trained a run already complete"

    site.proxy.restore()
    first_done = await finished(nc, run_id, timeout=120)
    assert first_done.state is RunState.COMPLETED and first_done.digest == want, first_done
    assert first_done.site == "lab1", first_done

    async def heard() -> bool:
        return all([of(await history(nc, r), Superseded) for r in (run_id, other)])

    await eventually(heard, 60, "both sides' superseded events at the hub")
    for r, winner, loser in ((run_id, "lab1", ""), (other, "", "lab1")):
        events = await history(nc, r)
        kinds = [type(e).__name__ for e in events]
        assert kinds.count("Completed") == 1, (r, kinds)
        [said] = of(events, Superseded)
        assert isinstance(said, Superseded) and (said.owner, said.loser) == (winner, loser), said
    # The hub tried the first run once, never again (no refusal loop).
    starts = [e for e in of(await history(nc, run_id), Started) if isinstance(e, Started)]
    assert len([e for e in starts if not e.worker.startswith("lab1-")]) == 1, starts
    [completed] = of(await history(nc, run_id), Completed)
    assert isinstance(completed, Completed) and completed.digest == want, completed
    final = await commit.read_latest(store, other)
    assert final is not None and final[0].final and final[0].site == "", final
