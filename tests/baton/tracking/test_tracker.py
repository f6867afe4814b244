"""A tracker's history is the uninterrupted run's, whatever kills its attempts: read back
with TensorBoard's own reader (`EventAccumulator`), from a real MLflow tracking server and
from W&B's offline files (those two in the `frameworks` tier: the server, and W&B's service
process, take seconds to start)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from baton.tracking.tracker import Tracker
from shared.contracts.tracking import Tracking
from tests.baton.tracking.driver import RUN, Driver, job, loss

TOTAL = 10


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def expected() -> list[tuple[int, float]]:
    import numpy as np

    return [(s, float(np.float32(loss(s)))) for s in range(TOTAL)]


def tensorboard(tmp_path: Path) -> Driver:
    return Driver(tmp_path, job({"kind": "tensorboard", "dir": str(tmp_path / "tb")}, TOTAL))


def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "tb" / "baton" / RUN


def test_an_uninterrupted_run_logs_each_step_once(tmp_path: Path) -> None:
    tensorboard(tmp_path).attempt()
    got = scalars(run_dir(tmp_path) / "baton", "loss")
    assert got == expected(), got


@pytest.mark.parametrize(
    "kills",
    [
        # killed between checkpoints (after 7 steps: 6 kept), then again just before one
        [{"kill_after": 7}, {"kill_after": 9, "commit_upto": 8}],
        # killed with checkpoint 9 committed but not heard of: its rows reach the tracker
        # from the checkpoint, by the attempt that resumes from it
        [{"kill_after": 9, "hear": False}],
        # twice, each time before the commit it had started could be heard of
        [{"kill_after": 4, "hear": False}, {"kill_after": 8, "hear": False}],
        # commits heard only after the next checkpoint was taken, then killed
        [{"kill_after": 8, "late": True}],
    ],
    ids=["between-and-before", "committed-unheard", "twice-unheard", "heard-late"],
)
def test_killed_attempts_leave_the_uninterrupted_history(
    tmp_path: Path, kills: list[dict[str, int | bool]]
) -> None:
    driver = tensorboard(tmp_path)
    driver.user_writer = True
    for kill in kills:
        driver.attempt(**kill)  # type: ignore[arg-type]
    ctx = driver.attempt()
    assert ctx.tracking is not None and ctx.tracking.purge_step is not None
    got = scalars(run_dir(tmp_path) / "baton", "loss")
    assert got == expected(), got
    user = scalars(run_dir(tmp_path), "user_loss")  # the user's own writer, purge_step
    assert user == expected(), user


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from tests.support.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server.uri
    finally:
        server.close()


def mlflow_history(uri: str, experiment: str) -> tuple[int, list[tuple[int, float]], str]:
    """(tracker runs in the experiment, the one run's loss history by step, its status)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    runs = client.search_runs([found.experiment_id])
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    points = sorted((m.step, m.value) for m in history)
    return len(runs), points, runs[0].info.status


KILLED = pytest.mark.parametrize(
    "kills",
    [
        [],
        [{"kill_after": 7}, {"kill_after": 9, "commit_upto": 8}],
        [{"kill_after": 4, "hear": False}, {"kill_after": 8, "hear": False}],
        # commits heard late: checkpoint 6 holds rows 0-5, of which 0-2 were written after
        # it was taken; the attempt resuming from it writes 3-5 only (the tracker says it
        # holds 0-2: MLflow's `baton.flushed_step`, W&B's files)
        [{"kill_after": 8, "late": True}],
    ],
    ids=["uninterrupted", "between-and-before", "twice-unheard", "heard-late"],
)
"""The attempts a tracker's run goes through, for the trackers whose history is read back
from their own stores."""


@pytest.mark.frameworks  # a tracking server of its own: ~9 s to start on 2 cores
@KILLED
def test_mlflow_holds_one_run_with_each_step_once(
    tmp_path: Path, mlflow_uri: str, kills: list[dict[str, int | bool]]
) -> None:
    from baton.tracking.tracker import prepare

    experiment = tmp_path.name
    tracking = {"kind": "mlflow", "uri": mlflow_uri, "project": experiment}
    driver = Driver(tmp_path, job(tracking, TOTAL))
    saved = dict(os.environ)
    try:
        for kill in [*kills, {}]:
            assert driver.spec.tracking is not None
            prepare(driver.spec.tracking, RUN, 0)  # as each training process does
            driver.attempt(**kill)  # type: ignore[arg-type]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    runs, points, status = mlflow_history(mlflow_uri, experiment)
    assert runs == 1, f"{runs} tracker runs"
    want = [(s, loss(s)) for s in range(TOTAL)]
    assert points == want, points
    assert status == "FINISHED", status


@pytest.fixture
def wandb_offline(tmp_path: Path) -> Iterator[Path]:
    """W&B in offline mode, its runs under the folder given; its service process (W&B's
    core, started by the first `wandb.init()` of a process) stopped at the end, with the
    environment the attempts set."""
    import wandb

    saved = dict(os.environ)
    os.environ["WANDB_SILENT"] = "true"
    try:
        yield tmp_path / "wandb"
    finally:
        wandb.teardown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.frameworks  # W&B's service process for each test: seconds on 2 cores
@KILLED
def test_wandb_holds_one_run_with_each_step_once(
    tmp_path: Path, wandb_offline: Path, kills: list[dict[str, int | bool]]
) -> None:
    """Read back from W&B's offline files (`wandb_files`): every process's folder of the
    one W&B run, each step's row once, the uninterrupted run's values."""
    import wandb

    from baton.tracking import identity, wandb_files
    from baton.tracking.tracker import prepare

    tracking = {"kind": "wandb", "mode": "offline", "dir": str(wandb_offline.parent)}
    driver = Driver(tmp_path, job(tracking, TOTAL))
    for kill in [*kills, {}]:
        assert driver.spec.tracking is not None
        prepare(driver.spec.tracking, RUN, 0)  # as each training process does
        driver.attempt(**kill)  # type: ignore[arg-type]
        if kill:  # its process is gone: W&B's run of it ends with it
            wandb.finish(exit_code=137)
        wandb.teardown()  # and W&B's service process with it (its file written whole)
    rows = wandb_files.history(wandb_offline, identity.wandb_id(RUN))
    want = [(s, loss(s)) for s in range(TOTAL)]
    assert [(step, values["loss"]) for step, values in rows] == want, rows
    folders = wandb_files.folders(wandb_offline, identity.wandb_id(RUN))
    assert len(folders) >= len(kills) + 1, folders  # one W&B run: each attempt's part of it


def test_an_attempt_that_hears_of_no_commit_finds_them_in_the_store(tmp_path: Path) -> None:
    """The trainer's word on each commit never reaches the last attempt (a lost event):
    closing, it sees its final commit in the store and writes every kept row."""
    driver = tensorboard(tmp_path)
    driver.attempt(kill_after=5)
    driver.attempt(hear=False)
    got = scalars(run_dir(tmp_path) / "baton", "loss")
    assert got == expected(), got


def test_a_rank_that_writes_nothing_buffers_nothing() -> None:
    """Only rank 0's metrics are the run's: no rows pile up in other ranks' checkpoints."""
    tb = Tracker(Tracking(kind="tensorboard", dir="/nowhere"), "r1", 1)  # rank 1: not the run's
    tb.stepped(0, {"loss": 1.0})
    assert tb.rows.state == {"rows": []}, tb.rows.state
