"""What `baton watch`, `status`, `runs` and the dashboard show as a run's loss, whatever
name its framework reports it under (`shared.contracts.events.loss_of`)."""

from __future__ import annotations

import pytest

from shared.contracts.events import loss_of


@pytest.mark.parametrize(
    ("metrics", "want"),
    [
        ({"loss": 1.0, "train_loss": 2.0}, 1.0),  # Baton's examples, HF's Trainer
        ({"train_loss": 2.0, "val_loss": 3.0}, 2.0),  # Lightning's usual name
        ({"train_loss_step": 2.5, "train_loss_epoch": 2.7}, 2.5),  # Lightning's on_step
        ({"train/loss": 0.5, "eval/loss": 0.7}, 0.5),
        ({"nll_loss": 0.3, "eval_loss": 0.4, "lr": 1e-3}, 0.3),  # one training loss
        ({"eval_loss": 0.4, "val_loss": 0.5}, None),  # validation only
        ({"a_loss": 1.0, "b_loss": 2.0}, None),  # which one is not ours to guess
        ({}, None),
    ],
)
def test_the_training_loss_is_found_under_its_usual_names(
    metrics: dict[str, float], want: float | None
) -> None:
    assert loss_of(metrics) == want
