"""The tracker run of a Baton run, and the environment that hands it to every attempt.

Invariant: every attempt of a run — after a kill, a preemption, a hand-over to another
trainer — names the same tracker run, and nothing has to be remembered between attempts
for it: the name is a function of the run id alone (invariant 1: identity is `run_id`).
A stored id (chosen at the first attempt, kept in the run record) would have to survive a
hub that forgets its unsynced tail; a derived one cannot be lost.

* TensorBoard: the log dir `<dir>/<project>/<run id>`.
* W&B: `WANDB_RUN_ID` = the run id, its characters outside W&B's alphabet replaced and a
  hash of the original added when any were; `WANDB_RESUME=allow` makes `wandb.init()` resume
  it when it exists.
* MLflow: the server assigns run ids, so the derived key is a tag: the run named by
  `baton.run_id` in the experiment, found or created once per attempt before the user's
  code runs (`baton.tracking.sinks.mlflow_run`), and handed over as `MLFLOW_RUN_ID`.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from shared.contracts.tracking import Tracking

RUN_TAG = "baton.run_id"
"""The MLflow tag naming the Baton run a tracker run belongs to."""


def wandb_id(run_id: str) -> str:
    """The W&B run id of Baton run `run_id`: W&B allows letters, digits, `-` and `_`."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)
    if safe == run_id:
        return run_id
    return f"{safe}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


def log_dir(tracking: Tracking, run_id: str) -> str:
    """TensorBoard's log dir for the run: one per Baton run, shared by its attempts."""
    return str(Path(tracking.dir or ".") / tracking.project / run_id)


def environment(tracking: Tracking, run_id: str, mlflow_run_id: str | None) -> dict[str, str]:
    """The variables each tracker's own client reads, for every attempt of `run_id`."""
    env: dict[str, str] = {"BATON_TRACKING_KIND": tracking.kind}
    if tracking.kind == "tensorboard":
        env["BATON_TENSORBOARD_DIR"] = log_dir(tracking, run_id)
    elif tracking.kind == "mlflow":
        env["MLFLOW_TRACKING_URI"] = tracking.uri or ""
        env["MLFLOW_EXPERIMENT_NAME"] = tracking.project
        if mlflow_run_id:
            env["MLFLOW_RUN_ID"] = mlflow_run_id
    else:
        env |= {
            "WANDB_RUN_ID": wandb_id(run_id),
            "WANDB_RESUME": "allow",
            "WANDB_PROJECT": tracking.project,
            "WANDB_NAME": run_id,
            "WANDB_MODE": tracking.mode,
        }
        if tracking.dir:
            env["WANDB_DIR"] = tracking.dir
        if tracking.uri:
            env["WANDB_BASE_URL"] = tracking.uri
    return env
