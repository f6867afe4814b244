"""Kill anything, lose nothing: SIGKILL, SIGTERM, a zombie, a blip, a damaged checkpoint.

Every test runs the real stack (nats-server, dispatcher, checkpointer, trainers as
processes) and compares final weights with an uninterrupted run of the same job: with
deterministic mode on they must be bitwise identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from baton.runtime.local import MARK, Mark
from shared.bus import names
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.checkpoint.store.base import sha256_file
from shared.contracts import CommitRequest, FileRef, JobSpec, Pointer, RunState, decode, encode
from shared.contracts.events import (
    CheckpointCommitted,
    CommitRefused,
    Fenced,
    HandedOver,
    Preempted,
    Progress,
    Redispatched,
    Restored,
    Started,
)
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.proxy import Proxy
from tests.support.stack import Stack, all_dead, attempt_processes, children_of, eventually

PACED = "tests.support.workloads:paced"


def paced(total: int = 100, every: int = 10, pace: float = 0.03, **over: Any) -> JobSpec:
    return job(
        entry_point=PACED,
        total_steps=total,
        checkpoint=over.pop("checkpoint", {"every_steps": every}),
        config={"pace": pace},
        seed=11,
        **over,
    )


async def reference_digest(stack: Stack, spec: JobSpec) -> str:
    nc = await stack.client()
    rec = await finished(nc, await submit(nc, spec), timeout=120)
    assert rec.state is RunState.COMPLETED and rec.digest
    return rec.digest


async def test_sigkill_at_four_points_resumes_bitwise_on_the_other_trainer(two: Stack) -> None:
    nc = await two.client()
    spec = paced()
    want = await reference_digest(two, spec)
    for i, at in enumerate((17, 48, 83)):
        run_id = await submit(nc, paced(idempotency_key=f"kill-{i}"))
        log = EventLog(nc, run_id)
        first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
        assert isinstance(first, Started)
        reached = await log.wait_for(
            lambda e, at=at: isinstance(e, Progress) and e.step >= at, 30, f"step {at}"
        )
        assert isinstance(reached, Progress)
        last_commit = max((e.step for e in log.of(CheckpointCommitted)), default=0)
        victim = two.pid(first.worker)
        family = children_of(victim)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        await all_dead(family, "the killed trainer's training process")
        await two.add_trainer(f"extra-{i}")  # keep two trainers up for the next round

        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED
        assert record.digest == want, f"kill at step {at}: weights differ from the reference"
        second = log.of(Started)[1]
        assert second.worker != first.worker and second.token > first.token
        # Handed over by the reaper the moment the server saw the connection close
        # (services/reaper/departures.py), not when its pulse or its lease ran out.
        handed = log.of(HandedOver)
        assert len(handed) == 1 and "connection closed" in handed[0].reason, handed
        step = next(e for e in log.of(Progress) if e.worker == second.worker)
        print(f"SIGKILL at step {at}: first resumed step {step.at - killed_at:.2f}s after")
        resumed = log.of(Restored)[1]
        assert last_commit <= resumed.step <= reached.step  # lost ≤ steps since last commit
        assert not log.of(Redispatched), "the task was still queued: nothing to re-dispatch"
        log.close()
    await _local_snapshot_round(two, want)


async def _local_snapshot_round(two: Stack, want: str) -> None:
    """With local snapshots (`baton.runtime.local`), a SIGKILL between two checkpoints costs
    no step: the heir on the same host resumes where the killed attempt's snapshot is, ahead
    of the newest commit, and the run ends bitwise the uninterrupted one (checkpoints every
    40 steps train the same bits as every 10)."""
    nc = await two.client()
    local = {"every_steps": 40, "local_every_seconds": 0}
    run_id = await submit(nc, paced(idempotency_key="local", checkpoint=local))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step == 40, 30, "40")
    snapped = await eventually(lambda: _snapshot_after(run_id, 50), 30, "a snapshot past 50")
    victim = two.pid(first.worker)
    family = children_of(victim)
    os.kill(victim, signal.SIGKILL)
    await all_dead(family, "the killed trainer's training process")
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.worker != first.worker, 30, "resume"
    )
    assert isinstance(resumed, Restored) and resumed.local, resumed
    committed = max(e.step for e in log.of(CheckpointCommitted))
    assert resumed.step >= snapped and resumed.step > committed
    record = await finished(nc, run_id)
    assert record.state is RunState.COMPLETED and record.digest == want
    print(f"SIGKILL past step {snapped}: resumed at {resumed.step}, newest commit {committed}")
    assert not list(_snapshots(run_id)), "a completed run leaves no local snapshot"
    log.close()


def _snapshots(run_id: str) -> Iterator[int]:
    """The steps of `run_id`'s local snapshots on this host (the tests' `BATON_SNAPSHOTS`)."""
    for mark in Path(os.environ["BATON_SNAPSHOTS"]).glob(f"*/snap-*/{MARK}"):
        with contextlib.suppress(OSError, ValueError):  # removed, or not yet whole
            found = msgspec.json.decode(mark.read_bytes(), type=Mark)
            if found.run_id == run_id:
                yield found.step


async def _snapshot_after(run_id: str, step: int) -> int | None:
    return max((s for s in _snapshots(run_id) if s > step), default=None)


async def test_sigterm_loses_no_step_and_hands_over_at_once(two: Stack) -> None:
    nc = await two.client()
    want = await reference_digest(two, paced(every=40))
    run_id = await submit(nc, paced(every=40, idempotency_key="term"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
    assert isinstance(first, Started)
    # Late enough that the other trainer is idle again after the reference.
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 60, 30, "step 60")
    two.signal(first.worker, signal.SIGTERM)
    pre = await log.wait_for(lambda e: isinstance(e, Preempted), 30, "preemption")
    assert isinstance(pre, Preempted) and pre.step % 40 != 0  # a checkpoint off the policy
    committed = next(e for e in log.of(CheckpointCommitted) if e.step == pre.step)
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.worker != first.worker, 30, "resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # zero lost steps
    step = await log.wait_for(
        lambda e: isinstance(e, Progress) and e.worker != first.worker, 30, "first resumed step"
    )
    print(f"SIGTERM hand-over: first resumed step {step.at - committed.at:.2f}s after the commit")
    # "At once": the heir took the lease the preempted trainer released, not one that lapsed
    # (a TTL later) or a redelivery (1.5 TTL); the seconds are bench/recovery.py's to measure.
    heir = next(e for e in log.of(Started) if e.worker != first.worker)
    assert heir.token > first.token and not log.of(Redispatched)
    assert heir.at - pre.at < two.opts.lease_ttl, "the hand-over waited for the lease to lapse"
    record = await finished(nc, run_id)
    assert record.digest == want
    await eventually(lambda: _exited(two, first.worker), 35, "the preempted trainer to exit 0")


async def _exited(stack: Stack, name: str) -> bool:
    return stack.sup.returncode(name) == 0


async def test_a_zombie_is_fenced_and_its_commit_refused(two: Stack) -> None:
    nc = await two.client()
    want = await reference_digest(two, paced(total=200))
    run_id = await submit(nc, paced(total=200, idempotency_key="zombie"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
    assert isinstance(first, Started)
    await log.wait_for(
        lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, 30, "a commit"
    )
    zombie = two.pid(first.worker)
    family = attempt_processes(zombie)
    os.kill(
        zombie, signal.SIGSTOP
    )  # its training child goes on, writing checkpoints nobody commits
    try:
        heir = await log.wait_for(
            lambda e: isinstance(e, Started) and e.worker != first.worker, 30, "takeover"
        )
        assert isinstance(heir, Started) and heir.token > first.token
        # Its pulse stopped: handed over for the silence, before its lease could lapse.
        handed = log.of(HandedOver)
        assert len(handed) == 1 and "no pulse" in handed[0].reason, handed
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.token == heir.token,
            30,
            "heir commit",
        )
    finally:
        os.kill(zombie, signal.SIGCONT)
    fenced = await log.wait_for(lambda e: isinstance(e, Fenced), 30, "the zombie to notice")
    assert isinstance(fenced, Fenced) and fenced.worker == first.worker
    await all_dead(family, "the zombie's training process")

    # Replay a commit the zombie would make, from files it really wrote: the store refuses it.
    async with open_store(two.store_url) as store:
        mine = sorted(k for k in await store.list(f"runs/{run_id}/data/{first.token:012d}/"))
        steps = sorted({int(k.split("/")[4]) for k in mine})
        latest = await commit.read_latest(store, run_id)
        assert latest is not None
        late = steps[-1]
        files = []
        for key in (k for k in mine if int(k.split("/")[4]) == late):
            size, digest = await store.stat(key)
            files.append(FileRef(name=key.rsplit("/", 1)[1], key=key, size=size, sha256=digest))
    req = CommitRequest(
        run_id=run_id, token=first.token, step=late, worker=first.worker, files=files
    )
    await nc.jetstream().publish(names.commit_subject(run_id), encode(req))
    refused = await log.wait_for(
        lambda e: isinstance(e, CommitRefused) and e.token == first.token and e.step == late,
        30,
        "refusal",
    )
    assert isinstance(refused, CommitRefused)
    assert not [e for e in log.of(CheckpointCommitted) if e.token == first.token and e.at > heir.at]

    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.digest == want
    # One lineage: every version `latest` ever held is strictly newer than the one before.
    log_dir = two.root / "store" / "runs" / run_id / "latest.d"
    history = [decode((log_dir / n).read_bytes(), Pointer) for n in sorted(os.listdir(log_dir))]
    assert all(b.supersedes(a) for a, b in itertools.pairwise(history))
    assert history[-1].token == record.token


async def test_a_blip_shorter_than_the_ttl_changes_nothing(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack", trainers=0, lease_ttl=6)
    proxy: Proxy | None = None
    try:
        await stack.start(("dispatcher", "checkpointer"))
        proxy = Proxy("127.0.0.1", stack.nats.port)
        await proxy.start()
        base = await stack.add_trainer("edge")
        assert base
        nc = await stack.client()
        await stack.ready(("dispatcher", "checkpointer", "trainer"))
        want = await reference_digest(stack, paced(total=150))
        run_id = await submit(nc, paced(total=150, idempotency_key="blip"))
        log = EventLog(nc, run_id)
        await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
        proxy.sever()
        await asyncio.sleep(3.0)  # the fault itself lasts TTL/2; nothing is being waited for
        proxy.restore()
        record = await finished(nc, run_id, timeout=60)
        assert record.state is RunState.COMPLETED and record.digest == want
        started = log.of(Started)
        assert len(started) == 1 and record.attempts == 1 and record.token == started[0].token
        info = await nc.jetstream().consumer_info(
            names.TASKS_STREAM, names.trainer_consumer("default")
        )
        assert info.num_redelivered == 0
    finally:
        await stack.stop()
        if proxy is not None:
            await proxy.stop()


async def test_a_damaged_checkpoint_is_skipped_on_resume(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack", trainers=1, lease_ttl=3)
    try:
        await stack.start()
        nc = await stack.client()
        want = await reference_digest(stack, paced())
        run_id = await submit(nc, paced(idempotency_key="bitrot"))
        log = EventLog(nc, run_id)
        first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
        assert isinstance(first, Started)
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.step >= 40, 30, "commits"
        )
        os.kill(stack.pid(first.worker), signal.SIGKILL)
        async with open_store(stack.store_url) as store:
            latest = await commit.read_latest(store, run_id)
            assert latest is not None
            manifest = await commit.load_manifest(store, latest[0].manifest)
        model = next(f for f in manifest.files if f.name == "model.safetensors")
        path = stack.root / "store" / model.key
        data = bytearray(path.read_bytes())
        data[len(data) - 7] ^= 0x10  # one bit, inside the tensor bytes
        path.write_bytes(bytes(data))
        assert sha256_file(path)[1] != model.sha256
        await stack.add_trainer("second")
        resumed = await log.wait_for(
            lambda e: isinstance(e, Restored) and e.worker == "second", 30, "resume"
        )
        assert isinstance(resumed, Restored)
        assert resumed.damaged == [manifest.step] and resumed.step < manifest.step
        record = await finished(nc, run_id)
        assert record.state is RunState.COMPLETED and record.digest == want
    finally:
        await stack.stop()


async def test_a_run_whose_task_a_late_ack_removed_is_dispatched_again(tmp_path: Path) -> None:
    stack = Stack(tmp_path / "stack", trainers=1, lease_ttl=3)
    try:
        await stack.start()
        nc = await stack.client()
        js = nc.jetstream()
        want = await reference_digest(stack, paced())
        run_id = await submit(nc, paced(idempotency_key="lost"))
        log = EventLog(nc, run_id)
        first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start")
        assert isinstance(first, Started)
        await log.wait_for(
            lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, 30, "a commit"
        )
        victim = stack.pid(first.worker)
        family = children_of(victim)
        os.kill(victim, signal.SIGKILL)
        await all_dead(family, "the killed trainer's training process")
        # What a stale worker's late ack does: the task's copy vanishes from the work queue.
        task = await js.get_last_msg(names.TASKS_STREAM, names.task_subject("default", run_id))
        await js.delete_msg(names.TASKS_STREAM, task.seq)
        await stack.add_trainer("second")
        again = await log.wait_for(lambda e: isinstance(e, Redispatched), 30, "re-dispatch")
        assert isinstance(again, Redispatched) and again.dispatch == 2
        record = await finished(nc, run_id)
        assert record.state is RunState.COMPLETED and record.digest == want
        assert record.dispatch == 2 and len(log.of(Redispatched)) == 1
    finally:
        await stack.stop()
