"""Writing kept rows to a tracker, and finding what an earlier attempt already wrote.

Invariant: a step's row reaches the tracker run once, whichever attempt writes it. Each
tracker gets there its own way:

* TensorBoard's event files are append-only, but its reader discards, at a `SessionLog`
  START event with step `s` (what `SummaryWriter(purge_step=s)` writes first), every event
  of step `s` or later written before it. An attempt opens its writer with `purge_step`
  at the first step it may write again, so anything an earlier attempt wrote from there on
  is dropped by every reader (TensorBoard's own `EventAccumulator` and its UI).
* MLflow appends metric points; writing one twice makes two. Every batch carries, in the
  same `log_batch` call, the tag `baton.flushed_step` (the newest step written): an attempt
  writes only rows past it.
* W&B appends history rows at the steps given. An attempt writes only rows past the newest
  step the run already holds: in its local files (`baton.tracking.wandb_files`: what every
  earlier process on this `WANDB_DIR` logged, offline or online) and, online, past the
  server's step counter, which a resumed run starts after its history.

The clients are imported here, lazily: only a run that configures the tracker loads one.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from baton.tracking import wandb_files
from baton.tracking.identity import RUN_TAG
from baton.tracking.rows import Row
from shared.contracts.tracking import Tracking

FLUSHED_TAG = "baton.flushed_step"
BATON_RUN = "baton"
"""The folder of the run's TensorBoard dir Baton's own metrics go to: a writer of its own,
apart from the user's (two writers purging in one folder would purge each other's steps),
shown by TensorBoard as the run `<run id>/baton`."""
MAX_BATCH = 1000
"""Metric points in one MLflow `log_batch` (its REST API's limit)."""


class Sink(Protocol):
    """A tracker's writer. Each call returns the newest step whose row the tracker now holds
    for good (-1: none), through which rows may leave the buffer and the checkpoints."""

    def resumed(self, step: int, restored: list[Row]) -> int:
        """The attempt resumed at `step` (0: fresh) with `restored` rows, all kept: write
        those the tracker does not hold yet."""

    def write(self, rows: list[Row]) -> int:
        """Write `rows` (kept, and past every row given before)."""

    def close(self, completed: bool) -> None: ...


class TensorBoard:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def resumed(self, step: int, restored: list[Row]) -> int:
        purge = min([step, *(r[0] for r in restored)])
        self._writer = summary_writer(self.log_dir, purge)
        return self.write(restored)

    def write(self, rows: list[Row]) -> int:
        for step, ms, metrics in rows:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step, walltime=ms / 1000)
        self._writer.flush()
        return rows[-1][0] if rows else -1

    def close(self, completed: bool) -> None:
        self._writer.close()


def summary_writer(log_dir: str, purge_step: int, **kwargs: Any) -> Any:
    """A `SummaryWriter` on `log_dir` whose reader drops what earlier writers logged at
    `purge_step` or later. Its file is named after the second it opens in, and readers take
    a dir's files in name order: it opens in a later second than any file there, so the
    purge comes after what it purges."""
    from torch.utils.tensorboard import SummaryWriter

    _after_newest_file(log_dir)
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step, **kwargs)


def _after_newest_file(log_dir: str) -> None:
    if not os.path.isdir(log_dir):
        return
    stamps = [
        int(m.group(1))
        for name in os.listdir(log_dir)
        if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", name))
    ]
    newest = max(stamps, default=0)
    while int(time.time()) <= newest:  # at most a second, and only right after another
        time.sleep(0.05)


class Mlflow:
    def __init__(self, tracking: Tracking, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking.uri)
        self.run_id = run_id
        """MLflow's id of the run (not Baton's)."""

    def resumed(self, step: int, restored: list[Row]) -> int:
        tags = self._client.get_run(self.run_id).data.tags
        flushed = int(tags.get(FLUSHED_TAG, "-1"))
        return max(flushed, self.write([r for r in restored if r[0] > flushed]))

    def write(self, rows: list[Row]) -> int:
        from mlflow.entities import Metric, RunTag

        batch: list[Metric] = []
        for i, (step, ms, metrics) in enumerate(rows):
            batch += [Metric(k, v, ms, step) for k, v in metrics.items()]
            last = i + 1 == len(rows)
            if last or len(batch) + len(rows[i + 1][2]) > MAX_BATCH:
                tag = RunTag(FLUSHED_TAG, str(step))
                self._client.log_batch(self.run_id, metrics=batch, tags=[tag])
                batch = []
        return rows[-1][0] if rows else -1

    def close(self, completed: bool) -> None:
        if completed:
            self._client.set_terminated(self.run_id, "FINISHED")


def mlflow_run(tracking: Tracking, run_id: str) -> str:
    """MLflow's id of Baton run `run_id`'s tracker run: the oldest run tagged with it in the
    experiment `tracking.project`, created (with the experiment) when there is none."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking.uri)
    experiment = client.get_experiment_by_name(tracking.project)
    if experiment is None:
        with contextlib.suppress(MlflowException):  # another run created it first
            client.create_experiment(tracking.project)
        experiment = client.get_experiment_by_name(tracking.project)
    assert experiment is not None
    found = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=1,
    )
    if found:
        return str(found[0].info.run_id)
    run = client.create_run(experiment.experiment_id, tags={RUN_TAG: run_id}, run_name=run_id)
    return str(run.info.run_id)


class Wandb:
    """The process's W&B run — the one the environment names (`identity.environment`),
    which a user's own `wandb.init()` then returns as well (W&B keeps one run per process).

    W&B's service writes a run's file in blocks, not row by row: what a process logged
    since its last block is lost with it when it is killed (measured: a SIGKILL seconds
    after a few rows leaves its file empty). So a row W&B was given stays in the buffer,
    and in the checkpoints, until the run's file holds it (`write` returns what the files
    hold); an attempt resuming from such a checkpoint writes what the files lack."""

    def __init__(self) -> None:
        import wandb

        self._wandb = wandb
        self._run: Any = wandb.run or wandb.init()
        self._before = -1
        """The newest step the run's other folders, earlier processes', hold."""
        self._sent = -1
        """The newest step this process gave W&B."""
        self._tail: wandb_files.Tail | None = None
        """This process's file of the run."""

    def resumed(self, step: int, restored: list[Row]) -> int:
        run, mine = self._run, self._folder()
        held = [
            wandb_files.newest_step(f, run.id)
            for f in wandb_files.folders(mine.parent, run.id)
            if f != mine
        ]  # fmt: skip
        # Online, the server's step counter of a resumed run starts past its history.
        self._before = self._sent = max([-1, *held, int(run.step) - 1])
        return self.write(restored)

    def write(self, rows: list[Row]) -> int:
        for step, _ms, metrics in rows:
            if step > self._sent:
                self._open().log(dict(metrics), step=step)
                self._sent = step
        folder = self._folder()
        if self._tail is None or self._tail.path.parent != folder:
            self._tail = wandb_files.Tail(folder / f"run-{self._run.id}.wandb")
        return max(self._before, self._tail.read())

    def close(self, completed: bool) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
            # `finish` returns before W&B's service process has written the run's file
            # whole; stopping the service waits for it (the attempt is over).
            self._wandb.teardown()

    def _folder(self) -> Path:
        return Path(self._open().dir).parent  # `<folder>/files`

    def _open(self) -> Any:
        if self._run is None or self._run is not self._wandb.run:
            # The user's code finished the run before Baton's last rows: the same run, again.
            self._run = self._wandb.run or self._wandb.init()
            self._before = max(self._before, self._sent)  # given to the finished part
        return self._run


def open_sink(tracking: Tracking, log_dir: str, mlflow_run_id: str | None) -> Sink | None:
    """The writer of Baton's own metrics for the tracker (None for an MLflow run not found)."""
    if tracking.kind == "tensorboard":
        return TensorBoard(str(Path(log_dir) / BATON_RUN))
    if tracking.kind == "mlflow" and mlflow_run_id:
        return Mlflow(tracking, mlflow_run_id)
    if tracking.kind == "wandb":
        return Wandb()
    return None
