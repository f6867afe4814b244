"""Lightning's default logger on a Baton run's tracker run (`baton.integrations.lightning`,
docs/tracking.md): the same for every attempt, each kept step once.

* TensorBoard: a `TensorBoardLogger` on the run's log dir (`<run>/lightning`) whose writer
  opens with `purge_step` at the step the attempt resumed at, so the steps it redoes
  replace what a killed attempt logged of them.
* MLflow, W&B: an `MLFlowLogger` on the run `MLFLOW_RUN_ID` names, a `WandbLogger` on the
  run Baton opened: the hyperparameters and `logger.experiment` as always, the metrics left
  to Baton's rows — what the module logs reaches the run through them (`BatonCallback`),
  each kept step once; logged by both, each redone step would be there twice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from baton.tracking.tracker import Tracker


def run_logger(tracking: Tracker) -> Any:
    """The logger for the run's tracker (imported only here: a run loads its tracker's)."""
    kind = tracking.config.kind
    if kind == "mlflow":
        return _mlflow(tracking)
    if kind == "wandb":
        return _wandb()
    return _tensorboard(tracking)


def _tensorboard(tracking: Tracker) -> Any:
    from lightning.pytorch.loggers import TensorBoardLogger

    class RunLogger(TensorBoardLogger):
        @property
        def experiment(self) -> Any:
            # Opened on first use, after `ckpt_path()` found the step to purge from.
            if self._experiment is None and tracking.purge_step is not None:
                self._kwargs["purge_step"] = tracking.purge_step
            return super().experiment

    return RunLogger(tracking.log_dir, name="", version="lightning", default_hp_metric=False)


def _mlflow(tracking: Tracker) -> Any:
    from lightning.pytorch.loggers import MLFlowLogger

    class RunLogger(MLFlowLogger):
        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            """Left to Baton's rows (the module's `self.log` reaches them through
            `BatonCallback`, each kept step once)."""

        def finalize(self, status: str = "success") -> None:
            """Left to Baton too: the run is FINISHED when the Baton run completes, not
            when an attempt's `fit` returns (a pause, a preemption)."""

    return RunLogger(
        experiment_name=tracking.config.project, tracking_uri=tracking.config.uri,
        run_id=os.environ.get("MLFLOW_RUN_ID"),
    )  # fmt: skip


def _wandb() -> Any:
    from lightning.pytorch.loggers import WandbLogger

    class RunLogger(WandbLogger):
        @property
        def experiment(self) -> Any:
            import wandb

            if self._experiment is None and wandb.run is not None:
                self._experiment = wandb.run  # the run Baton opened: no warning of a reuse
            return super().experiment

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            """Left to Baton's rows (as MLflow's, above)."""

    return RunLogger()
