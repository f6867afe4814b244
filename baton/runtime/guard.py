"""The divergence guard: a run that blows up stops at the step it did, before any
checkpoint of that step or after it can be committed.

Checked in the training process (rank 0's, whose metrics stand for the run's), once per
step, on the metrics the step reported (`ctx.report`, a framework's logged values), by the
job's `guard` (`shared.contracts.jobs.Guard`):

* `non_finite`: any of `guard.metrics` (by default `loss` and `grad_norm`) is NaN or
  infinite; and, before every checkpoint is written, any floating tensor of it is (the
  weights or the optimizer's state, whatever reported or not) — so a checkpoint holding a
  non-finite value is never committed. That check reads the checkpoint's host copy on the
  writer thread (`RunContext._vet`), off the training loop: a full pass over a gigabyte
  takes seconds on a CPU (measured: 4 to 18 times the copy), which the loop must not wait
  for; the loop stops at its next step boundary instead;
* `loss_spike` (when set): `loss` is more than `loss_spike` times its median over the last
  `spike_window` steps (judged once that many steps have been seen in this attempt).

A trip raises `GuardTripped`, a `BaseException`: the user's `except Exception` does not
swallow it, and it ends the attempt the way the trainer expects (`EXIT_GUARDED`), after
the message saying why (`shared.contracts.child.Tripped`). Checkpoints of earlier steps
still being written finish first: they are good.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping

import torch

from shared.contracts.child import Tripped
from shared.contracts.jobs import Guard


class GuardTripped(BaseException):
    """The step broke the job's guard; `tripped` says how."""

    def __init__(self, tripped: Tripped) -> None:
        super().__init__(
            f"step {tripped.step}: {tripped.metric} = {tripped.value} ({tripped.rule})"
        )
        self.tripped = tripped


class Watch:
    """One attempt's guard: fed each step's metrics, and each checkpoint's tensors."""

    def __init__(self, guard: Guard, enabled: bool = True) -> None:
        self.guard = guard
        self.enabled = enabled
        self._losses: deque[float] = deque(maxlen=guard.spike_window)

    def stepped(self, step: int, metrics: Mapping[str, float]) -> Tripped | None:
        """The trip that `step`'s metrics make, if any."""
        if not self.enabled:
            return None
        g = self.guard
        if g.non_finite:
            for name in g.metrics:
                value = metrics.get(name)
                if value is not None and not math.isfinite(value):
                    return Tripped(step=step, metric=name, value=repr(value), rule="non_finite")
        loss = metrics.get("loss")
        if g.loss_spike is not None and loss is not None and math.isfinite(loss):
            if len(self._losses) == self._losses.maxlen:
                median = statistics.median(self._losses)
                if median > 0 and loss > g.loss_spike * median:
                    return Tripped(
                        step=step, metric="loss", value=repr(loss), rule="loss_spike",
                        detail=f"more than {g.loss_spike:g} x the median {median:.6g} of the "
                        f"last {len(self._losses)} steps",
                    )  # fmt: skip
            self._losses.append(loss)
        return None

    def checked(
        self, step: int, groups: Mapping[str, Mapping[str, torch.Tensor]]
    ) -> Tripped | None:
        """The trip a checkpoint's tensors make: the first non-finite floating tensor."""
        if not (self.enabled and self.guard.non_finite):
            return None
        for file, tensors in groups.items():
            for name, t in _floating(tensors.items()):
                if not bool(torch.isfinite(t).all()):
                    where = name if name.startswith(f"{file}.") else f"{file}.{name}"
                    return Tripped(
                        step=step, metric=where, value="non-finite tensor",
                        rule="non_finite",
                        detail="a checkpoint holding it would be committed as good",
                    )  # fmt: skip
        return None


def _floating(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    return ((n, t) for n, t in items if t.is_floating_point() or t.is_complex())
