"""Run lifecycle, driven for real: stalls, crashes, poison tasks, deadlines, budgets,
cancels, orphans. Each test checks the final state, the events, and that no process is
left behind (the `lifecycle` fixture's teardown)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from baton.client import calls as client
from shared.bus import names
from shared.checkpoint import commit, retention
from shared.checkpoint.store import open_store
from shared.contracts import RunState, decode, run_id_for
from shared.contracts.events import (
    AttemptFailed,
    Cancelled,
    CheckpointCommitted,
    Failed,
    Fenced,
    Progress,
    Rejected,
    RunWarning,
    Started,
)
from shared.contracts.letters import DeadLetter
from shared.state.lease import Lease, is_held
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack, eventually, training_processes

FAST = {"BATON_SWEEP_INTERVAL": "0.5", "BATON_HEARTBEAT": "0.5"}


@pytest.fixture
async def lifecycle(tmp_path: Path) -> AsyncIterator[Stack]:
    pools = tmp_path / "pools.toml"
    pools.write_text("[pools.default]\nrate_per_hour = 3.6\nseconds_per_step = 0.5\n")
    env = {**FAST, "BATON_POOLS_FILE": str(pools)}
    # Stopping it also waits for every training process to exit.
    async with Stack(tmp_path / "stack", trainers=1, lease_ttl=3, env=env) as s:
        yield s


def spec(entry: str, **over: Any) -> Any:
    return job(entry_point=f"tests.support.workloads:{entry}", **over)


async def test_a_stalled_run_is_warned_then_stopped(lifecycle: Stack) -> None:
    nc = await lifecycle.client()
    run_id = await submit(
        nc, spec("stall", total_steps=50, limits={"stall_timeout_s": 2, "max_retries": 0})
    )
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.FAILED and "stalled" in (record.reason or "")
    events = await history(nc, run_id)
    warned = [e for e in events if isinstance(e, RunWarning)]
    assert [w.kind for w in warned] == ["stalled"]
    assert isinstance(events[-1], Failed) and "stalled" in events[-1].reason


async def test_user_code_that_raises_is_retried_then_failed_with_its_traceback(
    lifecycle: Stack,
) -> None:
    nc = await lifecycle.client()
    run_id = await submit(nc, spec("boom", total_steps=20, limits={"max_retries": 2}))
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.FAILED and record.retries == 3 and record.attempts == 3
    events = await history(nc, run_id)
    retried = [e for e in events if isinstance(e, AttemptFailed)]
    assert len(retried) == 2 and all("boom at step 3" in e.detail for e in retried)
    failed = events[-1]
    assert isinstance(failed, Failed) and "RuntimeError: boom at step 3" in failed.detail
    # The wait between a failure and the next attempt is the back-off: 2 s, then 4 s.
    starts = [e.at for e in events if isinstance(e, Started)]
    waits = [starts[i + 1] - retried[i].at for i in range(2)]
    assert 1.5 < waits[0] < waits[1], waits


async def test_a_task_that_kills_every_trainer_is_dead_lettered(tmp_path: Path) -> None:
    s = Stack(tmp_path / "stack", trainers=1, lease_ttl=2, env={**FAST, "BATON_MAX_DELIVER": "2"})
    try:
        await s.start()
        nc = await s.client()
        run_id = await submit(nc, spec("kill_trainer", total_steps=50))
        for i in range(2):  # each delivery takes a trainer down; bring up the next
            victim = "trainer-1" if i == 0 else f"t{i}"
            await eventually(lambda v=victim: _dead(s, v), 30, "the kill")
            await s.add_trainer(f"t{i + 1}")
        record = await finished(nc, run_id, timeout=60)
        assert record.state is RunState.FAILED and "2 deliveries" in (record.reason or "")
        js = nc.jetstream()
        letter = await js.get_last_msg(
            names.DLQ_STREAM, names.dlq_subject(names.trainer_consumer("default"))
        )
        assert letter.data is not None
        dead = decode(letter.data, DeadLetter)
        assert run_id in dead.payload.decode() and "deliveries" in dead.reason
        info = await js.stream_info(
            names.TASKS_STREAM, subjects_filter=names.task_subject("default", run_id)
        )
        assert not info.state.subjects, "the poison task must leave the work queue"
    finally:
        await s.stop()


async def _dead(stack: Stack, name: str) -> bool:
    return stack.sup.returncode(name) is not None


async def test_a_run_past_its_hard_deadline_fails_and_its_child_stops(lifecycle: Stack) -> None:
    nc = await lifecycle.client()
    # The deadline counts from submission: the trainer is first seen idle (a short run
    # done), so that the run starts well before its deadline however loaded the machine.
    warm = await finished(nc, await submit(nc, spec("paced", total_steps=3)), timeout=60)
    assert warm.state is RunState.COMPLETED
    # The deadline counts from submission: long enough that a loaded machine has started
    # the run before it passes.
    slow = spec("paced", total_steps=10_000, config={"pace": 0.05}, limits={"hard_timeout_s": 10})
    run_id = await submit(nc, slow)
    log = EventLog(nc, run_id)
    record = await finished(nc, run_id, timeout=60)
    assert record.state is RunState.FAILED and (record.reason or "").startswith("hard_timeout")
    assert log.of(Started), "the run was training when its deadline passed"

    async def child_gone() -> bool:
        return len(training_processes(lifecycle.root)) <= 1  # only the zygote is left

    await eventually(child_gone, 15, "the training process to stop")
    log.close()


async def test_budget_rejects_and_derives_the_deadline(lifecycle: Stack) -> None:
    nc = await lifecycle.client()
    # 0.5 s/step at 3.6/hour costs 0.0005 per step: 10 000 steps cost 5.
    too_dear = spec("paced", total_steps=10_000, limits={"max_cost": 1.0}, idempotency_key="dear")
    _, answer = await client.submit(nc, too_dear, 10)
    assert isinstance(answer, Rejected) and answer.path == "$.limits.max_cost"
    assert "estimated cost 5.00" in answer.reason and "over max_cost 1" in answer.reason
    assert await _no_record(nc, run_id_for("dear"))
    ok = spec("paced", total_steps=40, config={"pace": 0.01}, limits={"max_cost": 0.5})
    run_id = await submit(nc, ok)
    record = await finished(nc, run_id)
    assert record.state is RunState.COMPLETED
    assert record.estimated_cost == pytest.approx(0.02)
    assert (
        record.deadline_at is not None
        and record.deadline_at - record.created_at == pytest.approx(500)
    )
    assert record.actual_cost > 0 and record.busy_s > 0


async def _no_record(nc: Any, run_id: str) -> bool:
    try:
        await client.record(nc, run_id)
    except client.CliError:
        return True
    return False


async def test_cancel_a_queued_and_a_running_run(tmp_path: Path) -> None:
    s = Stack(tmp_path / "stack", trainers=0, lease_ttl=3, env=FAST)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        nc = await s.client()
        queued = await submit(nc, spec("paced", total_steps=100))
        log_of_queued = EventLog(nc, queued)
        await client.cancel(nc, queued, "not needed")
        record = await finished(nc, queued, timeout=20)
        assert record.state is RunState.CANCELLED and record.reason == "not needed"
        await log_of_queued.wait_for(lambda e: isinstance(e, Cancelled), 10, "cancelled")

        async def task_removed() -> bool:  # after the ending is announced
            info = await nc.jetstream().stream_info(
                names.TASKS_STREAM, subjects_filter=names.task_subject("default", queued)
            )
            return not info.state.subjects

        await eventually(task_removed, 10, "the cancelled queued run's task to be removed")
        log_of_queued.close()

        await s.add_trainer("t1")
        running = await submit(nc, spec("paced", total_steps=10_000, config={"pace": 0.03}))
        log = EventLog(nc, running)
        await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 10, 30, "training")
        await client.cancel(nc, running, "changed my mind")
        record = await finished(nc, running, timeout=30)
        assert record.state is RunState.CANCELLED and record.reason == "changed my mind"
        assert log.of(CheckpointCommitted), "a running run checkpoints before it stops"
        await log.wait_for(lambda e: isinstance(e, Cancelled), 10, "the cancelled event")

        async def acked() -> bool:  # the trainer acks the task once it has marked the run
            consumer = await nc.jetstream().consumer_info(
                names.TASKS_STREAM, names.trainer_consumer("default")
            )
            return consumer.num_ack_pending == 0 and consumer.num_pending == 0

        await eventually(acked, 30, "the cancelled run's task to be acked")
        log.close()
    finally:
        await s.stop()


async def test_an_orphan_gets_a_kill_command(tmp_path: Path) -> None:
    # A long TTL keeps the trainer's own lease check (every TTL/3) out of the way, so the
    # reaper's orphan sweep is what must notice.
    s = Stack(tmp_path / "stack", trainers=1, lease_ttl=60, env=FAST)
    try:
        await s.start()
        nc = await s.client()
        js = nc.jetstream()
        run_id = await submit(nc, spec("paced", total_steps=10_000, config={"pace": 0.03}))
        log = EventLog(nc, run_id)
        await log.wait_for(lambda e: isinstance(e, Progress), 30, "training")
        kv = await js.key_value(names.LEASES_BUCKET)
        # The lease goes to someone else behind the worker's back (the operator, who can
        # see the hub's lease secret, plays the intruder).
        key = s.lease_key(run_id)
        await kv.purge(key)
        intruder = Lease(js, run_id, "intruder", ttl_s=60, key=key)
        assert await intruder.acquire()
        fenced = await log.wait_for(lambda e: isinstance(e, Fenced), 15, "the kill command")
        assert isinstance(fenced, Fenced) and fenced.reason.startswith("orphan")

        async def child_gone() -> bool:
            return len(training_processes(s.root)) <= 1

        await eventually(child_gone, 15, "the orphaned training process to stop")
        workers = await client.workers(nc)
        assert [w.worker for w in workers] == ["trainer-1"] and workers[0].device in ("cpu", "cuda")
        log.close()
    finally:
        await s.stop()


async def test_retention_under_a_fast_cadence_keeps_the_last_k(tmp_path: Path) -> None:
    s = Stack(tmp_path / "stack", trainers=1, lease_ttl=3, env={**FAST, "BATON_GC_AGE": "1"})
    try:
        await s.start()
        nc = await s.client()
        # A periodic checkpoint due while the previous write is in flight is postponed
        # (baton.runtime.snapshot), so the cadence leaves each tiny write many times what it needs.
        quick = {"total_steps": 60, "checkpoint": {"every_steps": 2, "keep_last": 2}}
        reference = await finished(
            nc, await submit(nc, spec("paced", **quick, config={"pace": 0.02}))
        )
        # Pinned before it runs (a run's id follows from its idempotency key): a pin made
        # while it ran could come after a loaded machine's retention had passed the step.
        # Several steps: a loaded machine's postponed cadence may never commit any one of them.
        pins = set(range(6, 21, 2))
        pinned = spec("paced", **quick, config={"pace": 0.02}, idempotency_key="pinned")
        async with open_store(s.store_url) as store:
            for step in pins:
                await retention.pin(store, run_id_for("pinned"), step)
        run_id = await submit(nc, pinned)
        assert run_id == run_id_for("pinned")
        record = await finished(nc, run_id)
        assert record.state is RunState.COMPLETED and record.digest == reference.digest
        events = await history(nc, run_id)
        committed = {e.step for e in events if isinstance(e, CheckpointCommitted)}
        kept_pins = pins & committed
        assert kept_pins, committed
        async with open_store(s.store_url) as store:
            chain = await retention.committed_chain(store, run_id)
            # The final checkpoint and the one before it; which step that is depends on the
            # machine: a periodic checkpoint due while a write is in flight is postponed.
            kept = [m.step for m in chain][:2]
            assert kept[0] == 60 and len(kept) == 2 and kept[1] < 60, kept

            async def data_steps() -> set[int]:
                return {int(k.split("/")[4]) for k in await store.list(f"runs/{run_id}/data/")}

            # Retention runs after each commit, so what is left is the last two, the pinned
            # ones, and at most one a commit queued behind the final one had not yet removed —
            # once the retention after the last commits has run (the run may complete first).
            async def retained() -> bool:
                return len((await data_steps()) - {*kept_pins, *kept}) <= 1

            await eventually(retained, 30, "retention after the last commits")
            assert kept_pins <= await data_steps()
            assert len(await store.list(f"runs/{run_id}/manifests/")) <= 3 + len(kept_pins)
            # A zombie's files that were never committed are garbage once old enough.
            zombie = commit.data_key(run_id, 1, 5, "model.safetensors")
            await store.put_once(zombie, b"never committed")

            async def collected() -> bool:
                return zombie not in await store.list(f"runs/{run_id}/data/")

            await eventually(collected, 20, "the reaper to collect the zombie's files")
            assert kept_pins <= await data_steps()
    finally:
        await s.stop()


async def test_an_entry_point_outside_the_allow_list_is_refused_before_import(
    tmp_path: Path,
) -> None:
    # A lease TTL far longer than the test: a lease found free was released, not lapsed.
    s = Stack(tmp_path / "stack", trainers=1, lease_ttl=60, env={"BATON_ENTRY_ALLOW": "examples"})
    try:
        await s.start()
        nc = await s.client()
        refused = await submit(nc, spec("paced", total_steps=20))
        record = await finished(nc, refused)
        assert record.state is RunState.FAILED
        assert "'tests.support.workloads' is not allowed" in (record.reason or "")
        key = s.lease_key(refused)

        async def released() -> bool:
            return not await is_held(nc.jetstream(), key)

        await eventually(released, 10, "the refused run's lease to be released")
        events = await history(nc, refused)
        assert not [e for e in events if isinstance(e, Started)], "no attempt may start"
        assert record.attempts == 0
        allowed = await submit(nc, job(total_steps=30, config={"hidden": 16, "batch": 16}))
        assert (await finished(nc, allowed)).state is RunState.COMPLETED
    finally:
        await s.stop()
