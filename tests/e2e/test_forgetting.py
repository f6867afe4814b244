"""The hub forgets; the store does not (`shared.state.owner`, docs/architecture.md).

JetStream acknowledges a write before it is on disk: a host crash loses the unsynced tail of
the hub's streams — records, leases, tasks, events — while the checkpoint store keeps every
commit. `baton up` syncs every write on its single node, so here the loss is made by hand:
the hub's server is stopped and its store copied, training goes on (a lease changes hands,
a run completes), then the server is killed and started again on the copy.

Then nothing may depend on the hub remembering what the store knows: no token is issued at
or below one the store has seen, and a run whose chain ends in a final commit is COMPLETED
— also when its submitter, finding no record, submits it again. Real processes under `baton
up`'s authorization; a user's job (`examples/charlm.py`).
"""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import Accepted, CommitRefused, Completed, Started
from shared.state.grants import epoch_of
from shared.state.runs import Runs
from tests.e2e import jobs
from tests.e2e.jobs import finished, history
from tests.support.stack import Stack, all_dead, children_of, eventually
from tests.support.verify import no_violation

pytestmark = [pytest.mark.adversary, pytest.mark.timeout(420)]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "stack", trainers=2)
    s.audit.allow(r"sweep failed|nats: timeout", "the hub's server is stopped on purpose")
    await s.start()
    try:
        yield s
    finally:
        await s.stop()


async def record_of(nc: Client, run_id: str) -> RunRecord | None:
    found = await (await Runs.open(nc.jetstream())).get(run_id)
    return found[0] if found else None


def charlm(pace: float) -> JobSpec:
    spec = jobs.charlm(120, pace, name="forgetting", seed=9, every=10)
    return msgspec.structs.replace(spec, idempotency_key=uuid.uuid4().hex)


async def test_a_hub_that_lost_its_unsynced_tail_issues_no_token_the_store_has_seen(
    stack: Stack,
) -> None:
    nc = await stack.client()
    want = (await finished(nc, await jobs.submit(nc, charlm(0.0)), timeout=120)).digest
    assert want
    run_id = await jobs.submit(nc, charlm(0.15))

    async def committed(after: int) -> tuple[int, int] | None:
        async with open_store(stack.store_url) as store:
            latest = await commit.read_latest(store, run_id)
        if latest is None or latest[0].step <= after:
            return None
        return latest[0].token, latest[0].step

    first_token, step = await eventually(lambda: committed(0), 60, "a first checkpoint")
    [record] = [r for r in [await record_of(nc, run_id)] if r is not None]
    holder = record.worker
    assert holder is not None, record

    # What the hub will come back to: its store as it is now.
    server = stack.nats
    await server.stop()
    copy = stack.root / "forgotten"
    shutil.copytree(server.store_dir, copy)
    await server.start()

    # Inside the window the hub will forget: a run completes, and the first run changes
    # hands (its trainer SIGKILLed) and commits under its heir's token.
    short = charlm(0.0)
    done_id = await jobs.submit(nc, short)
    done = await finished(nc, done_id, timeout=120)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    victim = stack.pid(holder)
    family = children_of(victim)
    os.kill(victim, signal.SIGKILL)
    await all_dead(family, "the killed trainer's training process")

    async def handed_on() -> tuple[int, int] | None:
        found = await committed(step)
        return found if found is not None and found[0] > first_token else None

    seen_token, _ = await eventually(handed_on, 90, "the heir's commit past the kill")

    # The host goes: the hub's server and the heir with it. A fresh trainer comes.
    heir = stack.pid(next(t for t in ("trainer-1", "trainer-2") if t != holder))
    family = children_of(heir)
    os.kill(heir, signal.SIGKILL)
    await all_dead(family, "the heir's training process")
    await server.kill()
    shutil.rmtree(server.store_dir)
    shutil.copytree(copy, server.store_dir)
    await server.start()
    await stack.add_trainer("trainer-3")

    # The run completes exactly; no attempt after the loss held a token the store had seen.
    record = await finished(nc, run_id, timeout=240)
    assert record.state is RunState.COMPLETED and record.digest == want, record
    events = await history(nc, run_id)
    started = [e.token for e in events if isinstance(e, Started)]
    assert all(t == first_token or t > seen_token for t in started), (first_token, seen_token,
                                                                      started)
    refused = [e.token for e in events if isinstance(e, CommitRefused)]
    assert all(t >= seen_token for t in refused), (seen_token, refused)
    assert epoch_of(record.token or 0) >= 1, record  # moved past the store's epoch
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("Completed") == 1, kinds

    # The run that completed in the window: its record is gone with the tail. Submitted
    # again, it is COMPLETED from the store's final checkpoint, trained nothing.
    assert await record_of(nc, done_id) is None
    assert await jobs.submit(nc, short) == done_id
    again = await finished(nc, done_id, timeout=120)
    assert again.state is RunState.COMPLETED and again.digest == want, again
    events = await history(nc, done_id)
    assert [type(e) for e in events if isinstance(e, Accepted | Completed | Started)] == [
        Accepted, Completed
    ], events
    await no_violation(stack, nc)
