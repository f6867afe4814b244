"""The lease keeper's re-take after a lost renewal, against a real nats-server and store: a
lapsed lease nobody else used is taken back under a new token (and the child and the record
follow it); one whose run moved on meanwhile is released again and the attempt fenced.

The keeper talks to its child through a `send` callable; here it appends to a list."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from services.trainer.keeper import Keeper, Order
from shared.bus import names
from shared.bus.kvwrite import KvWriter
from shared.checkpoint import commit
from shared.checkpoint.store import Store, open_store
from shared.contracts import (
    CommitRequest,
    FileRef,
    JobSpec,
    RunRecord,
    RunState,
    convert,
    spec_hash,
)
from shared.contracts.child import Control
from shared.state.lease import Lease, holder, is_held
from shared.state.runs import Runs
from tests.support.stack import eventually

RUN = "rkeep"
SPEC = convert({"name": "k", "entry_point": "m:f", "total_steps": 100}, JobSpec)
KEEP_S = 15.0
"""Upper bound on the keeper's reaction, so a hang fails the test instead of the suite."""


@dataclass
class Held:
    """A run RUNNING under worker w1's lease, and a keeper for it (not yet keeping)."""

    js: JetStreamContext
    runs: Runs
    store: Store
    lease: Lease
    keeper: Keeper
    beat_now: asyncio.Event
    sent: list[Control] = field(default_factory=list)
    touches: int = 0

    def touch(self) -> Callable[[], Awaitable[None]]:
        async def touch() -> None:
            self.touches += 1

        return touch

    async def record(self) -> tuple[RunRecord, int]:
        found = await self.runs.get(RUN)
        assert found is not None
        return found

    async def keep(self) -> asyncio.Task[None]:
        """Start keeping, with a beat at once (as after a reconnect or a `wake`)."""
        self.beat_now.set()
        return asyncio.create_task(self.keeper.keep(self.touch()))

    async def lapse(self) -> None:
        """The lease is gone without its holder knowing: a marker where it was, so that
        the holder's next renewal loses its CAS and the key is free to take."""
        kv = KvWriter(self.js, names.LEASES_BUCKET)
        assert await kv.delete(self.lease.key, expected=self.lease.revision)
        assert not await is_held(self.js, self.lease.key)


async def held(nc: Client, tmp_path: Path, ttl_s: int = 30) -> Held:
    js = nc.jetstream()
    runs = await Runs.open(js)
    store = open_store(f"file://{tmp_path / 'store'}")
    lease = Lease(js, RUN, "w1", ttl_s)
    assert await lease.acquire()
    now = time.time()
    record = RunRecord(
        run_id=RUN, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=RunState.RUNNING, worker="w1", token=lease.token, attempts=1,
    )  # fmt: skip
    assert await runs.create(record)
    beat_now = asyncio.Event()
    sent: list[Control] = []
    keeper = Keeper(RUN, lease, runs, store, beat_now, sent.append)
    return Held(js, runs, store, lease, keeper, beat_now, sent)


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("how", ["expired", "deleted"])
async def test_a_lapsed_lease_nobody_used_is_retaken_under_a_new_token(
    declared: Client, tmp_path: Path, how: str
) -> None:
    h = await held(declared, tmp_path, ttl_s=2)  # renewed every 2/3 s once kept
    old = h.lease.token
    if how == "expired":  # no renewal ran (a stalled loop, a long cut): the server expired it

        async def lapsed() -> bool:
            return not await is_held(h.js, RUN)

        await eventually(lapsed, 10, "the lease to expire")
    else:
        await h.lapse()
    keeping = await h.keep()
    try:

        async def told() -> bool:
            return bool(h.sent)

        await eventually(told, KEEP_S, "the keeper to tell the child its new token")
        new = h.lease.token
        assert new > old, f"token {old} -> {new}"
        assert h.sent == [Control(action="token", token=new)], h.sent

        async def followed() -> RunRecord | None:
            record, _ = await h.record()
            return record if record.token == new else None

        record = await eventually(followed, KEEP_S, "the record to take the new token")
        assert (record.state, record.worker) == (RunState.RUNNING, "w1"), record
        assert h.keeper.orders.given is None, h.keeper.orders.reason
        now_held = await holder(h.js, RUN)
        assert now_held == "w1", now_held

        async def renewed() -> bool:  # and it goes on keeping it under the new token
            return h.lease.revision > new

        await eventually(renewed, KEEP_S, "a renewal of the re-taken lease")
        assert not keeping.done() and h.touches >= 2, h.touches
        assert h.sent == [Control(action="token", token=new)], "one retake, one Control"
    finally:
        await stopped(keeping)
        await h.lease.release()
        await h.store.close()


async def _committed_by_another(h: Held) -> None:
    """w2 took the lapsed lease, committed a checkpoint under its token, and let go."""
    other = Lease(h.js, RUN, "w2", 30)
    assert await other.acquire() and other.token > h.lease.token
    key = commit.data_key(RUN, other.token, 5, "meta.json")
    data = b'{"step": 5}'
    await h.store.put_once(key, data)
    ref = FileRef(
        name="meta.json", key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    req = CommitRequest(run_id=RUN, token=other.token, step=5, worker="w2", files=[ref])
    await commit.commit(h.store, req)
    await other.release()


async def _moved_by_another(h: Held) -> None:
    """w2 took the lapsed lease and started an attempt (the record names its token), then
    lost it in turn."""
    other = Lease(h.js, RUN, "w2", 30)
    assert await other.acquire()

    def mark(r: RunRecord) -> RunRecord:
        return msgspec.structs.replace(r, worker="w2", token=other.token, attempts=2)

    assert await h.runs.update(RUN, mark) is not None
    await other.release()


async def _ended(h: Held) -> None:
    """The run ended meanwhile (a hard timeout) while the lease was lapsed."""

    def end(r: RunRecord) -> RunRecord:
        return msgspec.structs.replace(r, state=RunState.FAILED, reason="hard_timeout: test")

    assert await h.runs.update(RUN, end) is not None


@pytest.mark.parametrize(
    "meanwhile", [_committed_by_another, _moved_by_another, _ended], ids=lambda f: f.__name__
)
async def test_a_lapsed_lease_whose_run_moved_on_is_released_again_and_fenced(
    declared: Client, tmp_path: Path, meanwhile: Callable[[Held], Awaitable[None]]
) -> None:
    h = await held(declared, tmp_path)
    old = h.lease.token
    await h.lapse()
    await meanwhile(h)
    before = await h.record()
    pointer = await commit.read_latest(h.store, RUN)
    keeping = await h.keep()
    try:
        await asyncio.wait_for(keeping, KEEP_S)  # a fenced keeper stops keeping

        orders = h.keeper.orders
        assert orders.given is Order.FENCE and orders.fenced, orders.given
        assert orders.reason == "the lease was taken over by another worker", orders.reason
        assert h.lease.token > old, "the keeper did re-take the lapsed lease first"
        assert not await is_held(h.js, RUN), "what the keeper re-took it must release again"
        assert h.sent == [], f"no new token for the child of a fenced attempt: {h.sent}"
        assert await h.record() == before, "a fenced keeper must not touch the record"
        assert await commit.read_latest(h.store, RUN) == pointer, "nor the checkpoints"
    finally:
        await stopped(keeping)
        await h.store.close()


async def test_once_the_verdict_is_decided_a_lapsed_lease_is_never_retaken(
    declared: Client, tmp_path: Path
) -> None:
    """The attempt's end is being written (through a long cut, say) when the lease lapses:
    the keeper stops keeping instead of re-taking it, so the record keeps the token the
    verdict's compare-and-swap names, and the attempt's own ending is not refused."""
    h = await held(declared, tmp_path)
    old = h.lease.token
    h.keeper.settling()
    await h.lapse()
    keeping = await h.keep()
    try:
        await asyncio.wait_for(asyncio.shield(keeping), KEEP_S)
        assert h.sent == [], "no new token for the child"
        assert h.keeper.orders.given is None, h.keeper.orders.reason
        assert not await is_held(h.js, RUN), "the lapsed lease was not taken again"
        record, _ = await h.record()
        assert record.token == old, f"the record's token moved: {old} -> {record.token}"

        def complete(r: RunRecord) -> RunRecord | None:  # the verdict's write, as settle's
            if r.token != old:
                return None
            return msgspec.structs.replace(r, state=RunState.COMPLETED)

        done = await h.runs.update(RUN, complete)
        assert done is not None and done.state is RunState.COMPLETED
    finally:
        await stopped(keeping)
        await h.store.close()
