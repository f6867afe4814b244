"""Forming a group, against a real nats-server: the calls a leader publishes, the priority
that keeps two groups from waiting on each other for ever, the keys that say a rank is
gone, and a zombie leader that can no longer touch the group that replaced it.

Members are played here by writing their keys; `tests/e2e/test_ranks.py` runs real ones."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.trainer.forming import FORM_GRACE_S, Formed, GaveWay, Superseded
from services.trainer.group import Leader
from shared.bus import names
from shared.contracts import JobSpec, RunRecord, Task, convert, decode, spec_hash
from shared.contracts.child import EXIT_GROUP_BROKEN, EXIT_USER_ERROR
from shared.contracts.groups import GroupKey, MemberKey, RankCall
from shared.state.groups import GroupStore, key_ttl
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.support.stack import eventually


def spec(ranks: int | dict[str, int]) -> JobSpec:
    return convert({"name": "g", "entry_point": "m:f", "total_steps": 10, "ranks": ranks}, JobSpec)


@dataclass
class Run:
    task: Task
    lease: Lease
    record: RunRecord
    msg: Msg


async def queued(
    nc: Client, run_id: str, ranks: int | dict[str, int], created_at: float, trained: int = 0
) -> Run:
    """A run's record, its task fetched from the pool's consumer, and its lease taken."""
    js = nc.jetstream()
    runs = await Runs.open(js)
    s = spec(ranks)
    record = RunRecord(
        run_id=run_id, spec=s, spec_hash=spec_hash(s), created_at=created_at,
        updated_at=created_at, group_size=trained,
    )  # fmt: skip
    assert await runs.create(record)
    task = Task(run_id=run_id, spec=s)
    await js.publish(names.task_subject("default", run_id), msgspec.json.encode(task))
    sub = await js.pull_subscribe(names.task_subject("default", run_id), durable=f"d{run_id}")
    (msg,) = await sub.fetch(1, timeout=5)
    lease = Lease(js, run_id, f"lead-{run_id}", 6)
    assert await lease.acquire()
    return Run(task, lease, record, msg)


@pytest.fixture
async def groups(declared: Client) -> AsyncIterator[GroupStore]:
    yield GroupStore(declared.jetstream(), None, key_ttl(6))


def leader(nc: Client, store: GroupStore, run: Run, runs: Runs) -> Leader:
    return Leader(
        nc, nc.jetstream(), store, runs, run.task, run.lease, run.record, run.lease.worker,
        "127.0.0.1",
    )  # fmt: skip


async def join(store: GroupStore, run: Run, rank: int, worker: str) -> MemberKey:
    me = MemberKey(
        run_id=run.task.run_id, epoch=run.lease.token, rank=rank, worker=worker, host="h"
    )
    assert await store.claim(names.member_key(run.task.run_id, run.lease.token, rank), me)
    return me


async def test_a_leader_calls_for_its_ranks_and_forms_once_all_are_held(
    declared: Client, groups: GroupStore
) -> None:
    runs = await Runs.open(declared.jetstream())
    run = await queued(declared, "rform", 3, time.time())
    lead = leader(declared, groups, run, runs)
    forming = asyncio.create_task(lead.form(run.msg, asyncio.Event(), wait_s=60))

    # One call per other rank, on the pool's calls subject, for this epoch.
    js = declared.jetstream()
    sub = await js.pull_subscribe(names.calls_of_pool("default"), durable="calls")
    calls: list[RankCall] = []
    while len(calls) < 2:
        calls += [decode(m.data, RankCall) for m in await sub.fetch(2, timeout=10)]
    assert sorted(c.rank for c in calls) == [1, 2]
    assert {c.epoch for c in calls} == {run.lease.token}

    # Partly formed: it waits, and the record says why.
    await join(groups, run, 1, "w1")

    async def says_why() -> bool:
        found = await runs.get("rform")
        return found is not None and "2 of 3 ranks held" in (found[0].waiting or "")

    await eventually(says_why, 10, "the record to say why the run waits")
    assert not forming.done()
    # A rank held by one trainer cannot be taken by another.
    other = MemberKey(run_id="rform", epoch=run.lease.token, rank=1, worker="w9", host="h")
    assert not await groups.claim(names.member_key("rform", run.lease.token, 1), other)

    await join(groups, run, 2, "w2")
    formed = await asyncio.wait_for(forming, 10)
    assert isinstance(formed, Formed) and [m.worker for m in formed.members] == ["w1", "w2"]


async def test_the_younger_of_two_forming_groups_gives_way(
    declared: Client, groups: GroupStore
) -> None:
    """Each holds a trainer the other needs: without priority both would wait for ever."""
    runs = await Runs.open(declared.jetstream())
    now = time.time()
    older = await queued(declared, "rold", 2, now - 10)
    younger = await queued(declared, "ryoung", 2, now)
    a = asyncio.create_task(
        leader(declared, groups, older, runs).form(older.msg, asyncio.Event(), 60)
    )
    b = leader(declared, groups, younger, runs)
    gave = await asyncio.wait_for(b.form(younger.msg, asyncio.Event(), 60), 10)
    assert isinstance(gave, GaveWay) and "rold" in gave.reason and gave.delay > 0
    await b.end()
    assert not a.done()  # the oldest never gives way to a younger one
    await join(groups, older, 1, "lead-ryoung")  # the trainer that gave way joins it
    assert isinstance(await asyncio.wait_for(a, 10), Formed)


async def test_a_group_that_cannot_form_gives_its_leader_back(
    declared: Client, groups: GroupStore
) -> None:
    runs = await Runs.open(declared.jetstream())
    run = await queued(declared, "rnever", 4, time.time())
    lead = leader(declared, groups, run, runs)
    gave = await lead.form(run.msg, asyncio.Event(), wait_s=1)
    assert isinstance(gave, GaveWay) and "1 of 4 ranks held" in gave.reason
    assert gave.delay == 1  # kept off the queue as long, so other runs get the trainer
    await lead.end()

    # Each try is a delivery, and deliveries are bounded: the wait grows with them.
    await run.msg.nak()
    sub = await declared.jetstream().pull_subscribe(
        names.task_subject("default", "rnever"), durable="drnever"
    )
    (again,) = await sub.fetch(1, timeout=5)
    assert again.metadata.num_delivered == 2
    gave = await leader(declared, groups, run, runs).form(again, asyncio.Event(), wait_s=1)
    assert isinstance(gave, GaveWay) and gave.delay == 2


async def test_a_silent_member_is_lost_and_a_failed_one_is_the_users(
    declared: Client, groups: GroupStore
) -> None:
    _, lead, (one, two) = await formed(declared, groups, "rwatch", 3)
    watching = asyncio.create_task(lead.watch())
    keep = asyncio.create_task(renew(groups, one, two))
    try:
        # w2's process fails in the user's code; w1 stops renewing (its trainer died).
        two = msgspec.structs.replace(
            two, state="exited", code=EXIT_USER_ERROR, user_error=True, tail="ValueError: x"
        )
        keep.cancel()
        keep = asyncio.create_task(renew(groups, two))
        await asyncio.wait_for(lead.broken.wait(), 10)
        cause = await lead.settle(EXIT_GROUP_BROKEN, "")
        # The lost rank outweighs the failure, which may only be a consequence of it.
        assert (cause.rank, cause.worker, cause.user) == (1, "w1", False)
        assert "silent" in cause.reason
    finally:
        keep.cancel()
        watching.cancel()
        await lead.end()


async def formed(
    nc: Client, groups: GroupStore, run_id: str, ranks: int
) -> tuple[Run, Leader, list[MemberKey]]:
    """A group of `ranks` formed (members `w1`, `w2`, …) and gone (rank 0 listening)."""
    runs = await Runs.open(nc.jetstream())
    run = await queued(nc, run_id, ranks, time.time())
    lead = leader(nc, groups, run, runs)
    forming = asyncio.create_task(lead.form(run.msg, asyncio.Event(), 60))
    members = [await join(groups, run, r, f"w{r}") for r in range(1, ranks)]
    assert isinstance(await asyncio.wait_for(forming, 10), Formed)
    await lead.go(port=12345)
    return run, lead, members


async def renew(store: GroupStore, *members: MemberKey) -> None:
    """What members' trainers do while they live: write their keys before the TTL runs out."""
    while True:
        for m in members:
            await store.put(names.member_key(m.run_id, m.epoch, m.rank), m)
        await asyncio.sleep(0.3)


async def test_a_zombie_leader_cannot_touch_the_group_that_replaced_it(
    declared: Client, groups: GroupStore
) -> None:
    run, old, _ = await formed(declared, groups, "rzomb", 2)

    # Its lease lapses; a new leader takes the run under a higher epoch.
    newer = Lease(declared.jetstream(), "rzomb", "heir", 6)
    await run.lease.release()
    assert await newer.acquire() and newer.token > old.epoch
    new_key = GroupKey(
        run_id="rzomb", pool="default", epoch=newer.token, ranks=2, leader="heir",
        priority=run.record.created_at,
    )  # fmt: skip
    await groups.put(names.group_key("default", "rzomb"), new_key)

    # The zombie wakes: its renewal is refused, and its end leaves the new key alone.
    with pytest.raises(Superseded):
        await old.renew()
    await old.go(port=2)  # nor can it announce a group: it breaks its own instead
    assert old.broken.is_set() and old.breakage is not None and not old.breakage.user
    await old.end()
    now = await groups.group("default", "rzomb")
    assert now is not None and now.epoch == newer.token


async def test_an_elastic_group_forms_with_the_ranks_it_holds_and_offers_to_grow(
    declared: Client, groups: GroupStore
) -> None:
    """min 1, max 3, last trained at 3: only slot 2's trainer comes, so after the grace it
    forms at 2 (slot 2 is rank 1), says it was resized, and offers one more rank; a trainer
    holding that offer makes the leader stop to grow."""
    runs = await Runs.open(declared.jetstream())
    run = await queued(declared, "relastic", {"min": 1, "max": 3}, time.time(), trained=3)
    lead = leader(declared, groups, run, runs)
    began = time.monotonic()
    forming = asyncio.create_task(lead.form(run.msg, asyncio.Event(), wait_s=60))
    me = await join(groups, run, 2, "w2")
    renewing = asyncio.create_task(renew(groups, me))  # its key outlives the grace
    formed = await asyncio.wait_for(forming, 10)
    renewing.cancel()
    assert isinstance(formed, Formed), formed
    assert [m.worker for m in formed.members] == ["w2"], formed
    assert time.monotonic() - began >= FORM_GRACE_S  # it waited for more before forming
    assert lead.ranks == 2 and lead.key.ranks == 2
    resized = lead.resized(step=40)
    assert resized is not None and (resized.from_ranks, resized.to_ranks) == (3, 2)
    assert resized.step == 40 and "no spare trainer" in resized.reason

    js = declared.jetstream()
    sub = await js.pull_subscribe(names.calls_of_pool("default"), durable="ecalls")
    await lead.go(port=1234)
    assert lead.key.members == [run.lease.worker, "w2"]  # rank 1 is slot 2's trainer
    calls: list[RankCall] = []
    while not any(c.grow for c in calls):
        calls += [decode(m.data, RankCall) for m in await sub.fetch(3, timeout=10)]
    (offer,) = [c for c in calls if c.grow]
    assert offer.rank == 1 and offer.epoch == run.lease.token  # the first free slot
    watching = asyncio.create_task(lead.watch())
    try:
        await join(groups, run, offer.rank, "w9")
        await asyncio.wait_for(lead.grow.wait(), 10)
        assert lead.grower == "w9" and not lead.broken.is_set()
    finally:
        watching.cancel()
        await lead.end()


async def test_an_elastic_group_below_its_min_waits_and_says_why(
    declared: Client, groups: GroupStore
) -> None:
    runs = await Runs.open(declared.jetstream())
    run = await queued(declared, "rmin", {"min": 2, "max": 3}, time.time())
    lead = leader(declared, groups, run, runs)
    forming = asyncio.create_task(lead.form(run.msg, asyncio.Event(), wait_s=60))

    async def says_why() -> str | None:
        found = await runs.get("rmin")
        return found[0].waiting if found else None

    why = await eventually(says_why, 10, "the record to say why the run waits")
    assert "fewer than its min of 2" in why and "1 rank(s) held" in why, why
    await asyncio.sleep(FORM_GRACE_S * 2)  # past the grace: still never formed with 1
    assert not forming.done()
    await join(groups, run, 1, "w1")
    formed = await asyncio.wait_for(forming, 10)
    assert isinstance(formed, Formed) and lead.ranks == 2
    assert lead.resized(step=0) is None  # its first group: nothing was resized
    await lead.end()
