"""The Hugging Face `Trainer` example (`examples/hf_lm.py`) under a real stack, as a user
runs it: SIGKILLed mid-run and resumed on the other trainer, SIGTERMed and handed over —
each ending on the bits of a run that never stopped — and its logged loss in `baton status
--json` and on the dashboard's loss chart.

One stack for the module: two trainers, restarted when they die (as `baton up` does), a
3-second lease.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client
from transformers import GPT2LMHeadModel

from shared.checkpoint.digest import weights_digest
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Diverged,
    Preempted,
    Progress,
    Restored,
    Started,
)
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.cli import as_json
from tests.support.dashboard import get, served
from tests.support.stack import Stack, all_dead, children_of, named_trainers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[3]
TOTAL = 60


def lm(key: str, *, pace: float = 0.04, every: int = 10) -> JobSpec:
    """The example at a test's size: a checkpoint every `every` steps, paced so that a
    signal lands mid-run (the pace changes no arithmetic)."""
    return job(
        name="hf-lm",
        entry_point="examples.hf_lm:train",
        total_steps=TOTAL,
        seed=42,
        checkpoint={"every_steps": every},
        config={"pace": pace, "batch": 8, "window": 32, "stride": 8},
        idempotency_key=key,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with named_trainers(tmp_path_factory.mktemp("hf"), ("h1", "h2"), restart=True) as s:
        yield s


_reference: dict[int, str] = {}


async def reference(nc: Client, every: int = 10) -> str:
    """The digest of the uninterrupted run (unpaced: the same arithmetic)."""
    if every not in _reference:
        run_id = await submit(nc, lm(f"reference-{every}", pace=0.0, every=every))
        record = await finished(nc, run_id, timeout=180)
        assert record.state is RunState.COMPLETED and record.digest, record.reason
        _reference[every] = record.digest
    return _reference[every]


async def test_a_trainer_run_killed_mid_run_resumes_on_the_other_trainer_bitwise(
    two: Stack,
) -> None:
    nc = await two.client()
    want = await reference(nc)
    run_id = await submit(nc, lm("killed"))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted) and e.step >= 20, 120, "commit")
    reached = await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 25, 60, "step 25")
    assert isinstance(reached, Progress)
    victim = two.pid(first.worker)
    family = children_of(victim)
    os.kill(victim, signal.SIGKILL)
    await all_dead(family, "the killed trainer's training process")

    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == want, "the resumed Trainer run ended on other weights"
    resumed = log.of(Restored)[-1]
    assert resumed.worker != first.worker and 20 <= resumed.step <= reached.step
    assert not log.of(Diverged), "the self-check found the resumed steps differ"
    # Both attempts saved, one loaded: no progress bar of transformers' in the run's log.
    for worker in (first.worker, resumed.worker):
        said = (two.root / "work" / worker / "logs" / f"{run_id}.log").read_text()
        assert "Writing model shards" not in said and "Loading weights" not in said, said[-2000:]
    log.close()


async def test_sigterm_saves_the_trainers_state_in_the_grace_and_loses_no_step(
    two: Stack,
) -> None:
    nc = await two.client()
    want = await reference(nc, every=1000)  # only the final and the preemption's checkpoint
    run_id = await submit(nc, lm("preempted", every=1000))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 15, 120, "step 15")
    two.signal(first.worker, signal.SIGTERM)
    pre = await log.wait_for(lambda e: isinstance(e, Preempted), 60, "preemption")
    assert isinstance(pre, Preempted) and 15 <= pre.step < TOTAL
    assert any(e.step == pre.step for e in log.of(CheckpointCommitted))
    resumed = await log.wait_for(
        lambda e: isinstance(e, Restored) and e.step > 0, 120, "the resume"
    )
    assert isinstance(resumed, Restored) and resumed.step == pre.step  # no step lost
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason
    assert record.digest == want
    assert not log.of(Diverged)
    log.close()


async def test_the_trainers_logged_loss_is_in_status_and_on_the_loss_chart(
    two: Stack, tmp_path: Path
) -> None:
    """…and `baton pull` gives a directory the Trainer's model loads from, holding the
    weights the run ended on."""
    nc = await two.client()
    # Paced so the run lasts seconds whatever the machine: the chart gets a point per
    # progress report (at most every BATON_PROGRESS_INTERVAL), and an unpaced run on a
    # fast or a briefly starved machine may report its 60 steps in only a few.
    run_id = await submit(nc, lm("metrics", pace=0.05))
    record = await finished(nc, run_id, timeout=180)
    assert record.state is RunState.COMPLETED, record.reason

    status = await as_json(two, "status", run_id)
    assert {"loss", "learning_rate", "grad_norm"} <= set(status["metrics"]), status["metrics"]
    async with served(nc, two.store_url) as url:
        view = await get(f"{url}api/runs/{run_id}")
    (attempt,) = view["attempts"]
    losses = [loss for _, loss in attempt["loss"] if loss is not None]
    final = str(tmp_path / "final")
    pulled = await as_json(two, "pull", run_id, final, "--store", two.store_url)
    assert pulled["digest"] == record.digest and pulled["final"]
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    assert weights_digest(model.state_dict()) == record.digest
    assert len(losses) == len(attempt["loss"]) >= 5, attempt["loss"]  # each with its loss
    assert all(0 < loss < 10 for loss in losses), attempt["loss"]
