"""The divergence guard's rules, on real tensors: non-finite metrics and tensors, and the
optional loss-spike rule against the median of the steps before."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from baton.runtime.context import RunContext
from baton.runtime.guard import GuardTripped, Watch
from shared.contracts.child import CheckpointReady, Tripped
from shared.contracts.jobs import Guard
from tests.baton.harness import Run, spec


def test_a_non_finite_guarded_metric_trips_at_its_step() -> None:
    watch = Watch(Guard())
    assert watch.stepped(1, {"loss": 0.5, "grad_norm": 2.0, "lr": math.nan}) is None
    tripped = watch.stepped(2, {"loss": math.nan})
    assert tripped is not None and (tripped.step, tripped.metric) == (2, "loss")
    assert (tripped.value, tripped.rule) == ("nan", "non_finite")
    inf = watch.stepped(3, {"loss": 0.1, "grad_norm": math.inf})
    assert inf is not None and (inf.metric, inf.value) == ("grad_norm", "inf")


def test_the_guard_can_be_told_what_to_watch_or_to_watch_nothing() -> None:
    assert Watch(Guard(metrics=("ppl",))).stepped(1, {"loss": math.nan}) is None
    assert Watch(Guard(metrics=("ppl",))).stepped(1, {"ppl": -math.inf}) is not None
    assert Watch(Guard(non_finite=False)).stepped(1, {"loss": math.nan}) is None
    assert Watch(Guard(), enabled=False).stepped(1, {"loss": math.nan}) is None


def test_a_checkpoint_holding_a_non_finite_tensor_trips() -> None:
    watch = Watch(Guard())
    good = {"model": {"w": torch.ones(3), "steps": torch.tensor([4])}}
    assert watch.checked(5, good) is None
    bad = {"model": {"w": torch.ones(3)}, "optimizer": {"exp_avg": torch.tensor([1.0, math.nan])}}
    tripped = watch.checked(5, bad)
    assert tripped is not None and tripped.metric == "optimizer.exp_avg", tripped
    assert Watch(Guard(non_finite=False)).checked(5, bad) is None


def test_a_loss_spike_trips_once_the_window_is_full() -> None:
    watch = Watch(Guard(loss_spike=3.0, spike_window=4))
    assert watch.stepped(1, {"loss": 100.0}) is None  # no window yet: not judged
    for step, loss in enumerate([1.0, 1.2, 0.9, 1.1], start=2):
        assert watch.stepped(step, {"loss": loss}) is None
    assert watch.stepped(6, {"loss": 2.0}) is None  # under 3 x the median
    tripped = watch.stepped(7, {"loss": 9.0})
    assert tripped is not None and tripped.rule == "loss_spike", tripped
    assert "median" in tripped.detail


def test_weights_gone_non_finite_unreported_are_never_handed_over_for_commit(
    tmp_path: Path,
) -> None:
    """Nothing is reported, but the weights turn NaN during step 5: the checkpoint of step
    3 is handed over, the next one the loop takes (6, or later when the writer was busy) is
    refused on the writer thread (off the training loop), the guard's `Tripped` is sent, and
    the attempt ends; nothing from step 6 on is ever handed over for commit."""
    run = Run(tmp_path, spec(total=12, every=3))
    weights = torch.nn.Linear(3, 2)

    def setup(ctx: RunContext) -> Callable[[int], None]:
        ctx.restore(model=weights)

        def body(step: int) -> None:
            if step == 5:
                with torch.no_grad():
                    weights.weight[0, 0] = math.nan

        return body

    with pytest.raises(GuardTripped) as raised:
        run.attempt(setup)
    tripped = raised.value.tripped
    assert tripped.step >= 6 and (tripped.metric, tripped.rule) == ("model.weight", "non_finite")
    sent = run.sent
    handed = [m.step for m in sent if isinstance(m, CheckpointReady)]
    assert handed == [3], handed
    assert [m for m in sent if isinstance(m, Tripped)] == [tripped]
