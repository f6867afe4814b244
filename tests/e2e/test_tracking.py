"""One tracker run per Baton run, each step logged once: a job with its own loop that
reports its loss, configured with a tracker, kills its training process twice — mid-way
between two checkpoints, and in the step just before one — and completes; the tracker,
read back from its own storage, holds one run whose loss history (steps and values) is
the uninterrupted run's, reported by an identical job that nothing killed.

TensorBoard's event files are read by TensorBoard's own reader (`EventAccumulator`), both
Baton's (`<run>/baton`) and the user's own `SummaryWriter` (`ctx.tracking.summary_writer()`);
MLflow's run is read from a real tracking server (`mlflow server`, SQLite behind it)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from shared.contracts import JobSpec, RunState
from shared.contracts.events import Started
from tests.e2e.jobs import finished, history, job, submit
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.frameworks, pytest.mark.asyncio(loop_scope="module")]

TOTAL = 40
KILLS = [13, 29]
"""Yielded steps whose body ends in a SIGKILL: 13 between checkpoints (10 and 20 steps
done), 29 in the step before the checkpoint of 30 steps done."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with Stack(tmp_path_factory.mktemp("tracking") / "stack", trainers=2, lease_ttl=3) as s:
        yield s


def tracked(tracking: dict[str, Any], marks: Path | None) -> JobSpec:
    config: dict[str, Any] = {"pace": 0.02}
    if marks is not None:
        marks.mkdir(parents=True, exist_ok=True)
        config |= {"kill_at": KILLS, "marks": str(marks)}
    return job(
        name="tracked", entry_point="tests.support.tracked:train", total_steps=TOTAL,
        checkpoint={"every_steps": 10}, config=config, tracking=tracking,
        idempotency_key=uuid.uuid4().hex,
    )  # fmt: skip


async def run_pair(stack: Stack, tracking: dict[str, Any], marks: Path) -> tuple[str, str]:
    """The killed run and the reference, submitted together; both completed."""
    nc = await stack.client()
    victim = await submit(nc, tracked(tracking, marks))
    reference = await submit(nc, tracked(tracking, None))
    for run_id in (victim, reference):
        record = await finished(nc, run_id, timeout=240)
        assert record.state is RunState.COMPLETED, (run_id, record.state)
    attempts = [e for e in await history(nc, victim) if isinstance(e, Started)]
    assert len(attempts) == 3, f"the victim ran {len(attempts)} attempts, not 3 (two kills)"
    return victim, reference


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


async def test_tensorboard_holds_the_uninterrupted_history(stack: Stack, tmp_path: Path) -> None:
    root = tmp_path / "tb"
    victim, reference = await run_pair(
        stack, {"kind": "tensorboard", "dir": str(root), "project": "p"}, tmp_path / "marks"
    )
    runs = sorted(p.name for p in (root / "p").iterdir())
    assert runs == sorted([victim, reference]), runs  # one log dir per Baton run
    for tag, sub in (("loss", "baton"), ("user_loss", "")):
        want = scalars(root / "p" / reference / sub, tag)
        got = scalars(root / "p" / victim / sub, tag)
        assert [s for s, _ in want] == list(range(TOTAL)), want
        assert got == want, f"{tag}: {got} != {want}"


async def test_mlflow_holds_one_run_with_the_uninterrupted_history(
    stack: Stack, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from tests.support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "mlflow")
    try:
        tracking = {"kind": "mlflow", "uri": server.uri, "project": "tracked"}
        victim, reference = await run_pair(stack, tracking, tmp_path / "marks")
        client = MlflowClient(tracking_uri=server.uri)
        experiment = client.get_experiment_by_name("tracked")
        assert experiment is not None
        runs = client.search_runs([experiment.experiment_id])
        names = sorted(r.data.tags.get("baton.run_id", "") for r in runs)
        assert names == sorted([victim, reference]), names  # one tracker run per Baton run
        by_run = {r.data.tags["baton.run_id"]: r for r in runs}
        points = {
            run_id: sorted((m.step, m.value) for m in client.get_metric_history(
                by_run[run_id].info.run_id, "loss"))
            for run_id in (victim, reference)
        }  # fmt: skip
        assert [s for s, _ in points[reference]] == list(range(TOTAL)), points[reference]
        assert points[victim] == points[reference], points
        assert {by_run[r].info.status for r in (victim, reference)} == {"FINISHED"}
    finally:
        server.close()
