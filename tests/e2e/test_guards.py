"""Operators' defaults, driven for real under `baton up`'s authorization: a hung run is
caught with no setting and a merely slow one never is; a run that blows up stops at the step
it did, and rolls back, fails fast or waits for a human as its job says; an operator pauses
and resumes a run. User-shaped jobs (`tests.support.guarded`): a data loader, an optimizer,
a scheduler, gradient clipping."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from baton.client import calls as client
from shared.checkpoint.store import open_store
from shared.contracts import RunState, Skip
from shared.contracts.events import (
    AttemptFailed,
    CheckpointCommitted,
    Failed,
    Guarded,
    Paused,
    Resumed,
    RunWarning,
    StallRecovered,
    Started,
)
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.cli import baton
from tests.support.stack import Stack, attempt_processes, eventually

pytestmark = pytest.mark.operations

# A stall is 10 x the run's median step, and at least 2 s; 30 s before it has stepped a few
# times. Production defaults are minutes (shared/config.py); the rule is the same.
STALLS = {"BATON_STALL_FLOOR": "2", "BATON_STALL_FACTOR": "10", "BATON_STALL_FIRST": "30"}


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[Stack]:
    async with Stack(
        tmp_path / "stack", trainers=2, lease_ttl=3,
        env={"BATON_SWEEP_INTERVAL": "0.5", "BATON_HEARTBEAT": "0.5", **STALLS},
    ) as s:  # fmt: skip
        yield s


def spec(entry: str, **over: Any) -> Any:
    return job(entry_point=f"tests.support.guarded:{entry}", **over)


async def manifests(stack: Stack, run_id: str) -> list[tuple[int, int]]:
    """(step, token) of every manifest the run ever committed."""
    async with open_store(stack.store_url) as store:
        keys = await store.list(f"runs/{run_id}/manifests/")
    return sorted(
        (int(name[:12]), int(name[13:25])) for name in (k.rsplit("/", 1)[1] for k in keys)
    )


async def test_a_hung_run_is_stopped_by_default_and_a_slow_one_never_flagged(
    guarded: Stack,
) -> None:
    nc = await guarded.client()
    hung = await submit(
        nc,
        spec("hangs", total_steps=40, config={"hang_at": 64, "step_s": 0.3, "shuffle": False},
             limits={"max_retries": 0}, checkpoint={"every_steps": 4}),
    )  # fmt: skip
    slow = await submit(
        nc, spec("slow", total_steps=6, config={"step_s": 3.0}, checkpoint={"every_steps": 2})
    )
    log = EventLog(nc, hung)
    started = await log.wait_for(lambda e: isinstance(e, Started), 60, "the hung run to start")
    assert isinstance(started, Started)
    trainer = guarded.pid(started.worker)
    await log.wait_for(
        lambda e: isinstance(e, RunWarning) and e.kind == "stalled", 90, "the stall warning"
    )
    record = await finished(nc, hung, timeout=90)
    assert record.state is RunState.FAILED and "stalled" in (record.reason or ""), record
    # Its training process is gone (the GPU freed), and its trainer holds nothing.
    assert attempt_processes(trainer) == []
    events = await history(nc, hung)
    assert [e.kind for e in events if isinstance(e, RunWarning)] == ["stalled"]
    assert not any(isinstance(e, StallRecovered) for e in events)
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and "stalled" in failed[0].reason, failed
    # The step it hung in: batch 8 (samples 64..71, in order); nothing was lost before it.
    assert max(e.step for e in events if isinstance(e, CheckpointCommitted)) == 8

    done = await finished(nc, slow, timeout=120)
    assert done.state is RunState.COMPLETED, done
    assert not [e for e in await history(nc, slow) if isinstance(e, RunWarning)]
    log.close()


async def test_a_run_that_hangs_at_the_same_step_in_every_attempt_ends_within_three_bounds(
    guarded: Stack,
) -> None:
    """A deterministic hang under the default policy (retries left): the first attempt is
    warned and stopped at 1.5 bounds; the retry resumes from the last checkpoint, is held to
    the run's known step time from its restore (not the first-steps bound, 30 s here) and
    hangs after the same step, which ends the run. Seen before: every retry waited out the
    first-steps bound again (1800 s by default), a GPU held for hours."""
    nc = await guarded.client()
    hung = await submit(
        nc,
        spec("hangs", total_steps=40, config={"hang_at": 64, "step_s": 1.2, "shuffle": False},
             limits={"max_retries": 3}, checkpoint={"every_steps": 4}),
    )  # fmt: skip
    record = await finished(nc, hung, timeout=240)
    assert record.state is RunState.FAILED, record
    assert "a hang that repeats is not retried" in (record.reason or ""), record.reason
    assert record.attempts == 2 and record.retries == 2, record
    events = await history(nc, hung)
    [warning] = [e for e in events if isinstance(e, RunWarning) and e.kind == "stalled"]
    quiet_s, bound_s = (float(x) for x in re.findall(r"(\d+)s", warning.detail)[:2])
    hang_began = warning.at - quiet_s
    [failed] = [e for e in events if isinstance(e, Failed)]
    took = failed.at - hang_began
    print(f"hung after step 8 twice; a stall is {bound_s:.0f} s; ended {took:.1f} s after")
    assert took <= 3 * bound_s, f"ended {took:.1f} s after the first hang (bound {bound_s} s)"
    [stopped] = [e for e in events if isinstance(e, AttemptFailed)]
    assert stopped.reason.startswith("stalled: no step for") and "after step 8" in stopped.reason
    assert failed.reason.startswith("stalled: no step for") and "after step 8" in failed.reason


async def test_a_nan_rolls_back_to_the_last_good_checkpoint_skipping_its_batches(
    guarded: Stack,
) -> None:
    nc = await guarded.client()
    # Sample 100 is in batch 12 (in order): the loss of step 12 is not finite, so the
    # state after it (step 13) must never be committed; the last good checkpoint is 10.
    run_id = await submit(
        nc,
        spec("poisoned", total_steps=30, config={"poison": 100, "shuffle": False},
             checkpoint={"every_steps": 5}, guard={"action": "rollback"},
             limits={"max_retries": 0}),
    )  # fmt: skip
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.retries == 0, record
    events = await history(nc, run_id)
    guards = [e for e in events if isinstance(e, Guarded)]
    assert len(guards) == 1, guards
    g = guards[0]
    assert (g.step, g.metric, g.rule, g.action) == (13, "loss", "non_finite", "rollback"), g
    # The last good checkpoint is the newest committed before it: 10 by the cadence, or an
    # earlier one if a loaded machine's writes postponed that one (a periodic checkpoint
    # never waits for the one before).
    first, second = [e for e in events if isinstance(e, Started)]
    committed = [
        e.step for e in events if isinstance(e, CheckpointCommitted) and e.token == first.token
    ]
    assert g.good_step == max(committed) and g.good_step <= 12, (g, committed)
    assert record.skips == [Skip(after=g.good_step, batches=13 - g.good_step)], record
    assert second.start_step == g.good_step
    # What users read: the guard's stop, the data left out, the interruption by its cause.
    code, out, err = await baton(guarded, "status", run_id)
    assert code == 0, err
    assert f"step 13: loss = inf (non_finite); rollback from step {g.good_step}" in out, out
    assert f"{13 - g.good_step} batch(es) after step {g.good_step}" in out, out
    assert "divergence 1 (mean" in out, out
    # Nothing from the step that blew up on was ever committed under the first attempt.
    assert all(
        step < 13 for step, token in await manifests(guarded, run_id) if token == first.token
    )
    assert all(v == v for v in record.metrics.values()), record.metrics  # finite to the end


async def test_a_nan_fails_fast_when_the_job_says_so(guarded: Stack) -> None:
    nc = await guarded.client()
    run_id = await submit(
        nc,
        spec("poisoned", total_steps=30, config={"poison": 100, "shuffle": False},
             checkpoint={"every_steps": 5}, on_failure="fail_fast"),
    )  # fmt: skip
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.FAILED and record.attempts == 1, record
    assert "divergence guard" in (record.reason or ""), record
    events = await history(nc, run_id)
    assert [e.action for e in events if isinstance(e, Guarded)] == ["stop"]
    assert all(step < 13 for step, _ in await manifests(guarded, run_id))


async def test_a_failure_pauses_for_a_human_who_resumes_it(guarded: Stack) -> None:
    nc = await guarded.client()
    run_id = await submit(
        nc,
        spec("fails_once", total_steps=20, config={"fail_at": 6, "step_s": 0.05},
             checkpoint={"every_steps": 4}, on_failure="pause"),
    )  # fmt: skip
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: isinstance(e, Paused), 90, "the run to pause")
    code, out, err = await baton(guarded, "status", run_id)
    assert code == 0 and "PAUSED" in out, out + err
    code, out, err = await baton(guarded, "resume", run_id, "--reason", "looked at it")
    assert code == 0, out + err
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.retries == 0, record
    events = await history(nc, run_id)
    kinds = [type(e).__name__ for e in events if isinstance(e, AttemptFailed | Paused | Resumed)]
    assert kinds == ["AttemptFailed", "Paused", "Resumed"], kinds
    resumed = [e for e in events if isinstance(e, Started)][-1]
    assert resumed.start_step == 4  # from its last checkpoint before the failure
    log.close()


async def test_an_operator_pauses_a_running_run_and_resumes_it_losing_no_step(
    guarded: Stack,
) -> None:
    nc = await guarded.client()
    run_id = await submit(
        nc,
        spec("slow", total_steps=400, config={"step_s": 0.05}, checkpoint={"every_steps": 1000}),
    )  # fmt: skip
    log = EventLog(nc, run_id)
    await log.wait_for(lambda e: getattr(e, "step", 0) >= 5, 90, "the run to step")
    code, out, err = await baton(guarded, "pause", run_id, "--reason", "maintenance")
    assert code == 0 and "PAUSED" in out, out + err
    paused = await log.wait_for(lambda e: isinstance(e, Paused), 30, "the paused event")
    assert isinstance(paused, Paused) and paused.reason == "maintenance"
    kept = max(e.step for e in log.of(CheckpointCommitted))
    assert kept > 5  # it checkpointed where it stopped, off its cadence

    async def nobody_holds_it() -> bool:
        return all(w.run_id != run_id for w in await client.workers(nc))

    await eventually(nobody_holds_it, 30, "its trainer to let it go")
    code, out, err = await baton(guarded, "resume", run_id)
    assert code == 0, out + err
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record
    resumed = [e for e in log.of(Started)][-1]
    assert resumed.start_step == kept
    log.close()


TUNED = """
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


def train(ctx):
    g = torch.Generator().manual_seed(ctx.seed)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    batches = ctx.data_loader(data, batch_size=16)
    ctx.restore(model=model, optimizer=opt, scheduler=sched)
    for step in ctx.steps():
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.report(loss=loss.item())
        time.sleep(ctx.config.get("step_s", 0.0))
"""


async def test_a_deterministic_run_under_changed_code_is_paused_until_its_operator_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's training loop (a data loader, an optimizer, a scheduler) in its own module,
    paused by its operator, whose code is then edited: the resume compares what the
    checkpoint recorded (torch, Python, Baton, the entry point's code) with what runs now,
    and a deterministic run is PAUSED again, saying what changed, before a step. Resumed
    with `--allow-changes`, it trains to the end, and says so in a warning event and in
    `baton status`. Seen before: it resumed silently, no longer exactly."""
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "tuned.py").write_text(TUNED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(code_dir), os.environ.get("PYTHONPATH", "")
    ])))  # fmt: skip
    async with Stack(tmp_path / "stack", trainers=1, lease_ttl=3) as stack:
        nc = await stack.client()
        run_id = await submit(nc, job(
            entry_point="tuned:train", total_steps=60, deterministic=True,
            checkpoint={"every_steps": 5}, config={"step_s": 0.05},
        ))  # fmt: skip
        log = EventLog(nc, run_id)
        await log.wait_for(lambda e: isinstance(e, CheckpointCommitted), 90, "a checkpoint")
        code, out, err = await baton(stack, "pause", run_id, "--reason", "a fix to deploy")
        assert code == 0 and "PAUSED" in out, out + err
        (code_dir / "tuned.py").write_text(TUNED + "\n# the fix\n")

        code, out, err = await baton(stack, "resume", run_id)
        # Queued, or already refused by the time it looked (the refusal comes before a step).
        assert code == 0 or "other software" in out, out + err
        refused = await log.wait_for(
            lambda e: isinstance(e, Paused) and "other software" in e.reason, 90, "the refusal"
        )
        assert isinstance(refused, Paused) and "entry point's code" in refused.reason, refused
        code, out, _ = await baton(stack, "status", run_id)
        assert "PAUSED" in out and "allow-changes" in out, out

        code, out, err = await baton(stack, "resume", run_id, "--allow-changes")
        assert code == 0, out + err
        record = await finished(nc, run_id, timeout=120)
        assert record.state is RunState.COMPLETED and record.changes_allowed, record
        assert record.changed and "entry point's code" in record.changed[0], record.changed
        warnings = [e for e in await history(nc, run_id) if isinstance(e, RunWarning)]
        assert [w.kind for w in warnings] == ["changed_since_checkpoint"], warnings
        code, out, _ = await baton(stack, "status", run_id)
        assert "other software than its checkpoint" in " ".join(out.split()), out
        log.close()

