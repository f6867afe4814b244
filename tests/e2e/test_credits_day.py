"""One owner's mixed day on a priced pool balances to the unit (docs/scheduling.md,
"Credits"): runs completed, killed, preempted by a higher priority, paused at their budget
and resumed after a top-up, failed and rolled back, forked, submitted at a site during a
cut, while a node of the three-node hub is killed. At the end every run ended is settled
once per life, no hold is left, the balance is the top-ups less the charges, and each
charge is what the run's own events say — its productive and own-failure trainer-seconds
at the price — recomputed here from them; the history checker finds nothing.

The owner is `lab1-submitter`: a person at the hub and the site's submitter at lab1 (a run
submitted at a site is its submitter's). Real processes under `baton up`'s authorization:
the fault campaign's stack (`tests.support.campaign.campaign_stack`) on three hub nodes,
the runs the character model (a shuffling loader, AdamW, a cosine schedule) and, for the
run that fails, a regression whose own code raises until the test mends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import calls as client
from baton.client.rebase import fork_spec
from shared.bus import names
from shared.bus import sourcing as sources
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.control import Resume, Rollback
from shared.contracts.events import Accepted, CheckpointCommitted, Paused, Preempted, Reopened
from shared.contracts.ledger import Settle, TopUp
from shared.contracts.pools import units
from shared.history.collect import collect
from shared.history.verify import check, describe
from shared.ledger import book
from shared.ledger.charges import charge, life_events
from shared.state.runs import Runs
from shared.state.workers import live_workers
from tests.e2e.jobs import finished, history, job, submit
from tests.support.campaign import CLUSTER, PERSON, PRICE, SITE_SUBMITTER, campaign_stack
from tests.support.campaign import spec_of as campaign_spec
from tests.support.ledger import settled, topup
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.sharing, pytest.mark.timeout(900)]

OWNER = SITE_SUBMITTER
NODE = 2
"""The hub node killed (not the first: the site's proxy leads to that one)."""


@pytest_asyncio.fixture
async def day(tmp_path: Path) -> AsyncIterator[tuple[Stack, Site]]:
    # No grants to lab1 (its trainer takes the hub's work across the link): every run the
    # hub holds may be preempted, so carol's run, arriving with every trainer busy, takes
    # one of the owner's trainers rather than a site's queue.
    env = {"BATON_DELEGATE_AHEAD": "lab1=0"}
    async with campaign_stack(tmp_path, CLUSTER, people=(PERSON, OWNER), env=env) as pair:
        yield pair


def spec(index: int, pace: float, **over: object) -> JobSpec:
    """The campaign's job `index`, priced on a 30 s estimate until its name has history."""
    return campaign_spec(index, pace, uuid.uuid4().hex, **{"estimate_s": 30.0, **over})


def failing(mend: Path) -> JobSpec:
    """Its own code raises at step 35 until `mend` exists."""
    return job(
        name="day-fails", entry_point="tests.support.tunable:gated", total_steps=60,
        checkpoint={"every_steps": 10, "keep_last": 20}, on_failure="fail_fast",
        config={"fail_at": 35, "mend": str(mend), "pace": 0.05}, estimate_s=5,
        idempotency_key=uuid.uuid4().hex,
    )  # fmt: skip


async def record(nc: Client, run_id: str) -> RunRecord | None:
    with contextlib.suppress(Exception):  # a node lost: a read may go unanswered a moment
        found = await (await Runs.open(nc.jetstream())).get(run_id)
        return found[0] if found else None
    return None


async def reaches(
    nc: Client, run_id: str, what: str, ok: Callable[[RunRecord], bool], timeout: float = 180
) -> RunRecord:
    async def now() -> RunRecord | None:
        r = await record(nc, run_id)
        return r if r is not None and ok(r) else None

    return await eventually(now, timeout, f"{run_id} {what}")


async def test_one_owners_mixed_day_balances_to_the_unit(
    day: tuple[Stack, Site], tmp_path: Path
) -> None:
    stack, site = day
    op, me = await stack.client(), await stack.client_as(OWNER)
    carol = await stack.client_as(PERSON)
    topped = [await topup(op, OWNER, 20.0)]
    await topup(op, PERSON, 20.0)
    lives: dict[str, int] = {}  # each of the owner's runs → its last life

    # Submitted at the site while it is cut off: trained to the end there, taken in at heal.
    # First, while the site's trainer trains nothing of the hub's (one that is cut off at
    # the end of a hub task waits for the link to write the hub's record).
    site.proxy.sever()
    try:

        async def cut() -> bool:
            with contextlib.suppress(Exception):
                return "lab1" not in await sources.linked(op)
            return False

        await eventually(cut, 30, "the hub to see lab1 cut off", 0.5)
        at_site = await site.client("submitter")
        there, answer = await client.submit(at_site, spec(1, 0.1), 20, "lab1")
        assert isinstance(answer, Accepted), answer
        lives[there] = 0

        at_lab1 = await Runs.open(
            (await site.client()).jetstream(), bucket=names.site_runs_bucket("lab1")
        )

        async def completed_there() -> bool:
            found = await at_lab1.get(there)
            return found is not None and found[0].state is RunState.COMPLETED

        await eventually(completed_there, 180, "the site's run to complete during the cut", 0.5)
    finally:
        site.proxy.restore()

    # More than the three trainers (the hub's two, the site's) can take at once, each
    # training long enough (18 s and more) for what follows to find it busy.
    done = await submit(me, spec(0, 0.3))
    killed = await submit(me, spec(1, 0.2))
    crowd = [await submit(me, spec(2, 0.3)) for _ in range(3)]
    lives |= dict.fromkeys([done, killed, *crowd], 0)

    # Preempted: carol's run at a higher priority, once every trainer trains the owner's.
    async def all_busy() -> bool:
        with contextlib.suppress(Exception):
            held = {w.run_id for w in await live_workers(op.jetstream())}
            return len(held & set(lives)) == 3
        return False

    await eventually(all_busy, 120, "every trainer training the owner's runs")
    ahead = await submit(carol, spec(0, 0.1, priority=10))
    await reaches(op, ahead, "started", lambda r: r.state is not RunState.QUEUED)

    async def made_room() -> bool:
        for run_id in list(lives):
            r = await record(op, run_id)
            if r is not None and r.preemptions:
                return True
        return False

    await eventually(made_room, 60, "an owner's run preempted for carol's", 0.5)

    # Held for one second of estimate (five trainer-seconds with the pool's margin):
    # paused at its budget well before its 18 s of training. A name of its own: its hold
    # is its own estimate, not its job's history.
    frugal = await submit(me, spec(0, 0.3, estimate_s=1.0, name="day-frugal"))
    lives[frugal] = 0

    # Killed: its trainer SIGKILLed once it has kept a checkpoint (restarted, as `baton up`).
    kept = await reaches(op, killed, "past a checkpoint", lambda r: r.step >= 10 and bool(r.worker))
    pid = stack.sup.pid(kept.worker or "")
    assert pid is not None, kept.worker
    os.kill(pid, signal.SIGKILL)

    # A hub node killed while they train, started again ten seconds later.
    node = stack.hub.nodes[NODE]
    await node.kill()
    try:
        await asyncio.sleep(10)  # the outage's length: the fault itself, not a wait
    finally:
        await node.start()

    # Paused at its budget; topped up and resumed, it goes on from its checkpoint.
    paused = await reaches(op, frugal, "paused", lambda r: r.state is RunState.PAUSED)
    assert (paused.pause_requested or "").startswith("budget"), paused
    topped.append(await topup(op, OWNER, 5.0))
    await client.steer(me, Resume(run_id=frugal))

    # Failed by its own code and settled; mended and rolled back: a second life.
    mend = tmp_path / "mend"
    failed = await submit(me, failing(mend))
    lives[failed] = 1
    end = await finished(op, failed, 180)
    assert end.state is RunState.FAILED, end
    await settled(op, OWNER, failed, timeout=120)
    await reaches(op, failed, "marked settled", lambda r: r.settled, 60)
    steps = [e.step for e in await history(op, failed) if isinstance(e, CheckpointCommitted)]
    mend.touch()
    await client.steer(me, Rollback(run_id=failed, step=min(steps), reason="mended"))

    # Forked from the completed run's checkpoint at step 30.
    parent = await finished(op, done, 180)
    assert parent.state is RunState.COMPLETED, parent
    fork = await submit(me, fork_spec(parent, 30, [], None, uuid.uuid4().hex))
    lives[fork] = 0

    # Every run ends; each life of the owner's runs is settled once.
    ends = {r: await finished(op, r, 300) for r in [*lives, ahead]}
    assert all(e.state is RunState.COMPLETED for e in ends.values()), {
        r: (e.state.value, e.reason) for r, e in ends.items()
    }
    assert ends[failed].life == 1, ends[failed]
    settles = [
        await settled_life(op, r, life) for r, last in lives.items() for life in range(last + 1)
    ]

    # The day had each of its things in it.
    events = {r: await history(op, r) for r in lives}
    assert any(isinstance(e, Preempted) and e.by == ahead for es in events.values() for e in es)
    assert any(isinstance(e, Paused) and e.reason.startswith("budget") for e in events[frugal])
    assert [e.life for e in events[failed] if isinstance(e, Reopened)] == [1]
    assert ends[killed].attempts >= 2, ends[killed]

    # To the unit: each charge is what its life's events say, at the price; the balance is
    # the top-ups less the charges; no hold is left.
    for s in settles:
        spent = charge(life_events(events[s.run_id], s.life), ends[s.run_id].price)
        assert (s.charged, s.productive_s) == (spent.charged, spent.productive_s), (s, spent)
        assert s.charged == units((s.productive_s + s.failed_s) * PRICE), s
        assert s.refund == s.held - s.charged, s
    account = (await book.read(op, OWNER, keep=True))[OWNER]
    entries = [e for _, e in account.entries]
    assert sum(e.amount for e in entries if isinstance(e, TopUp)) == sum(topped)
    lives_settled = sorted((e.run_id, e.life) for e in entries if isinstance(e, Settle))
    assert lives_settled == sorted((s.run_id, s.life) for s in settles), lives_settled
    assert account.balance == sum(topped) - sum(s.charged for s in settles), account.balance
    assert not account.holds, account.holds
    async with open_store(stack.store_url) as store:
        found = await collect(op, store)
    broken = check(found, settled_exactly=True)
    assert broken == [], [describe(v) for v in broken]


async def settled_life(nc: Client, run_id: str, life: int) -> Settle:
    if life == 0:
        return await settled(nc, OWNER, run_id, timeout=180)
    js = nc.jetstream()

    async def found() -> Settle | None:
        entry = await book.find(js, book.settle_subject(OWNER, run_id, life))
        return entry if isinstance(entry, Settle) else None

    return await eventually(found, 180, f"{run_id}'s life {life} settled")
