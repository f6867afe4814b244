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

The clients are imported here, lazily: only a run that configures the tracker loads one.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

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
    def resumed(self, step: int, restored: list[Row]) -> None:
        """The attempt resumed at `step` (0: fresh) with `restored` rows, all kept."""

    def write(self, rows: list[Row]) -> None: ...

    def close(self, completed: bool) -> None: ...


class TensorBoard:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def resumed(self, step: int, restored: list[Row]) -> None:
        purge = min([step, *(r[0] for r in restored)])
        self._writer = summary_writer(self.log_dir, purge)
        self.write(restored)

    def write(self, rows: list[Row]) -> None:
        for step, ms, metrics in rows:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step, walltime=ms / 1000)
        self._writer.flush()

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

    def resumed(self, step: int, restored: list[Row]) -> None:
        tags = self._client.get_run(self.run_id).data.tags
        flushed = int(tags.get(FLUSHED_TAG, "-1"))
        self.write([r for r in restored if r[0] > flushed])

    def write(self, rows: list[Row]) -> None:
        from mlflow.entities import Metric, RunTag

        batch: list[Metric] = []
        for i, (step, ms, metrics) in enumerate(rows):
            batch += [Metric(k, v, ms, step) for k, v in metrics.items()]
            last = i + 1 == len(rows)
            if last or len(batch) + len(rows[i + 1][2]) > MAX_BATCH:
                tag = RunTag(FLUSHED_TAG, str(step))
                self._client.log_batch(self.run_id, metrics=batch, tags=[tag])
                batch = []

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


def open_sink(tracking: Tracking, log_dir: str, mlflow_run_id: str | None) -> Sink | None:
    """The writer of Baton's own metrics for the tracker (None for W&B: see docs/tracking.md)."""
    if tracking.kind == "tensorboard":
        return TensorBoard(str(Path(log_dir) / BATON_RUN))
    if tracking.kind == "mlflow" and mlflow_run_id:
        return Mlflow(tracking, mlflow_run_id)
    return None
