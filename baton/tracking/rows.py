"""The metrics of the steps a run has done but no committed checkpoint has kept yet.

Invariant: a row leaves the buffer only once the tracker holds it for good, and only when
a committed checkpoint keeps its step (a checkpoint at step `c` keeps steps `0..c-1`). The
buffer is registered with the run's checkpoints (`restore()`, as `baton_tracking`), so a
checkpoint holds the rows not yet written when it was taken: an attempt killed after that
checkpoint committed but before its rows reached the tracker leaves them to the next
attempt, which resumes from that checkpoint with them (`baton.tracking.tracker`).
"""

from __future__ import annotations

import math
from typing import Any

Row = tuple[int, int, dict[str, float]]
"""(step, wall time in milliseconds, metrics): one step's report."""

SLOT = "baton_tracking"
"""The name the buffer is checkpointed under."""


class Rows:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"rows": []}
        """The JSON tree checkpointed (`[[step, ms, {name: value}], ...]`, by step)."""

    def stepped(self, step: int, at_ms: int, metrics: dict[str, float]) -> None:
        """Step `step` reported `metrics`. Non-finite values are left out: JSON cannot hold
        them, and the divergence guard stops a run that reports one by default."""
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        if finite:
            self.state["rows"].append([step, at_ms, finite])

    def kept(self, committed: int) -> list[Row]:
        """The rows a checkpoint at step `committed` keeps (steps before it), oldest first."""
        return [(s, ms, dict(m)) for s, ms, m in self.state["rows"] if s < committed]

    def written(self, through: int) -> None:
        """Rows up to step `through` are in the tracker for good: forget them."""
        self.state["rows"] = [r for r in self.state["rows"] if r[0] > through]
