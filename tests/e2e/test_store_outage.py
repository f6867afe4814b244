"""The object store goes down under a running job: training goes on and nothing is lost.

Acceptance: S3 down for twice the checkpoint interval — training goes on; commits succeed
after it returns; no checkpoint is lost. The store is a real SeaweedFS, stopped and started
again on the same ports and data under a job that checkpoints every second, on the real
stack (nats-server, dispatcher, checkpointer, trainer and its training child as processes).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunState
from shared.contracts.events import CheckpointCommitted, CommitRefused, Progress, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.seaweed import SeaweedS3
from tests.support.stack import Stack, eventually

INTERVAL_S = 1.0
OUTAGE_S = 2 * INTERVAL_S
# About 12 s of training: long enough that it is still going well after the store is back.
TOTAL_STEPS = 500
PACE_S = 0.02


def paced(**over: Any) -> JobSpec:
    return job(
        entry_point="tests.support.workloads:paced",
        total_steps=TOTAL_STEPS,
        # Retention keeps every checkpoint, so each one committed must still be there.
        checkpoint={"every_steps": None, "every_seconds": INTERVAL_S, "keep_last": 1000},
        config={"pace": PACE_S},
        seed=7,
        **over,
    )


@pytest.fixture
def seaweed(monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        # For this process's own look into the store; the services get it in their env.
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture
async def s3_stack(tmp_path: Path, seaweed: SeaweedS3) -> AsyncIterator[Stack]:
    env = {**seaweed.env(), "BATON_STORE": seaweed.url(f"outage-{uuid.uuid4().hex[:8]}")}
    s = Stack(tmp_path / "stack", trainers=1, lease_ttl=4, env=env)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


@pytest.mark.timeout(90)
async def test_training_outlasts_a_store_outage_and_loses_no_checkpoint(
    s3_stack: Stack, seaweed: SeaweedS3
) -> None:
    store_url = s3_stack.opts.extra_env["BATON_STORE"]
    nc = await s3_stack.client()
    reference = await finished(nc, await submit(nc, paced()), timeout=60)
    assert reference.state is RunState.COMPLETED and reference.digest

    run_id = await submit(nc, paced())
    log = EventLog(nc, run_id)
    run_log = s3_stack.root / "work" / "trainer-1" / "logs" / f"{run_id}.log"
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted), 30, "a first commit")
    loop = asyncio.get_running_loop()
    down = False
    try:
        await asyncio.to_thread(seaweed.stop)
        down, down_at, seen = True, loop.time(), len(log.events)
        before = max(e.step for e in log.of(CheckpointCommitted))

        async def writer_waits() -> bool:
            return run_log.exists() and "store unreachable" in run_log.read_text()

        # A checkpoint comes due within one interval; its upload must meet the outage.
        await eventually(writer_waits, 10, "the checkpoint writer to find the store down")
        # The rest of the outage is the fault itself: nothing is being waited for.
        await asyncio.sleep(max(0.0, down_at + OUTAGE_S - loop.time()))
        mark = max(e.step for e in log.of(Progress))
        # Still training at the end of the outage, not stalled behind the stuck upload.
        await log.wait_for(
            lambda e: isinstance(e, Progress) and e.step > mark, 5, "a step while S3 is down"
        )
        during = [e.step for e in log.events[seen:] if isinstance(e, Progress)]
        await asyncio.to_thread(seaweed.start)
        down = False
    finally:
        if down:
            await asyncio.to_thread(seaweed.start)
    print(f"store down {loop.time() - down_at:.1f} s; steps {during[0]}..{during[-1]} meanwhile")
    assert len(during) >= 5 and all(a < b for a, b in itertools.pairwise(during)), during

    after = await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step > before, 30, "a commit after"
    )
    assert isinstance(after, CheckpointCommitted)
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.COMPLETED, record
    assert record.digest == reference.digest, "weights differ from the uninterrupted run"
    # One attempt: the outage neither crashed the training process nor stalled it into a
    # takeover.
    assert len(log.of(Started)) == 1 and record.attempts == 1, log.of(Started)
    assert not log.of(CommitRefused), log.of(CommitRefused)
    assert "store is back" in run_log.read_text()

    committed = {e.step: e.manifest for e in log.of(CheckpointCommitted)}
    assert [e.step for e in log.of(CheckpointCommitted) if e.final] == [TOTAL_STEPS]
    async with open_store(store_url) as store:
        written = {
            int(key.split("/")[4])
            for key in await store.list(f"runs/{run_id}/data/{record.token or 0:012d}/")
        }
        # Every checkpoint whose files were uploaded was committed: none went missing
        # between the writer, the trainer and the checkpointer.
        assert written == set(committed), (sorted(written), sorted(committed))
        for step, key in sorted(committed.items()):
            manifest = await commit.load_manifest(store, key)
            assert manifest.step == step
            await commit.verify(store, manifest.files)  # restorable: every file intact
    log.close()


@pytest.mark.timeout(90)
async def test_an_attempt_that_starts_while_the_store_is_down_waits_for_it(
    s3_stack: Stack, seaweed: SeaweedS3
) -> None:
    nc = await s3_stack.client()
    pid = s3_stack.pid("trainer-1")
    # In a thread, as above: waiting for the server blocks, and a blocked loop misses the
    # client's NATS pings (a disconnect, then a timed-out request, seen under load).
    await asyncio.to_thread(seaweed.stop)
    try:
        run_id = await submit(nc, job(entry_point="tests.support.workloads:paced", total_steps=40))

        async def gave_back() -> bool:
            return "the attempt failed outside the training process" in s3_stack.log("trainer-1")

        await eventually(gave_back, 30, "the trainer to give the run back")
        assert s3_stack.pid("trainer-1") == pid, "the trainer must outlive a store outage"
    finally:
        await asyncio.to_thread(seaweed.start)
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.COMPLETED and record.retries == 0, record
