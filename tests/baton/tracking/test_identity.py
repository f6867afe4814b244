"""The tracker run is named by the run id alone, and handed over in the variables each
tracker's own client reads."""

from __future__ import annotations

from baton.tracking.identity import environment, log_dir, wandb_id
from shared.contracts.tracking import Tracking


def test_every_attempt_names_the_same_tracker_run() -> None:
    wandb = Tracking(kind="wandb", project="p", dir="/w", mode="offline")
    env = environment(wandb, "alice.r1f2", None)
    assert env == environment(wandb, "alice.r1f2", None)  # nothing but the run id in it
    assert env["WANDB_RUN_ID"] == wandb_id("alice.r1f2") != "alice.r1f2"
    assert env["WANDB_RESUME"] == "allow" and env["WANDB_MODE"] == "offline"
    assert (env["WANDB_PROJECT"], env["WANDB_DIR"]) == ("p", "/w")
    assert wandb_id("r1f2") == "r1f2" and wandb_id("a.b") != wandb_id("a-b")


def test_mlflow_and_tensorboard_variables() -> None:
    mlflow = Tracking(kind="mlflow", project="exp", uri="http://h:5000")
    env = environment(mlflow, "r1", "abc")
    assert env["MLFLOW_TRACKING_URI"] == "http://h:5000" and env["MLFLOW_RUN_ID"] == "abc"
    assert env["MLFLOW_EXPERIMENT_NAME"] == "exp"
    assert "MLFLOW_RUN_ID" not in environment(mlflow, "r1", None)
    tb = Tracking(kind="tensorboard", project="p", dir="/logs")
    assert environment(tb, "r1", None)["BATON_TENSORBOARD_DIR"] == "/logs/p/r1" == log_dir(tb, "r1")
