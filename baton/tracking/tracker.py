"""`ctx.tracking`: a run's tracker, as one attempt's training process sees it.

Invariant: the tracker run holds each kept step's metrics once, and no step a committed
checkpoint did not keep — the history an uninterrupted run would have left. Rows wait in
the buffer (`baton.tracking.rows`) until the trainer says a checkpoint of this attempt is
committed (`committed`, from its control thread), and are written on the training thread
at the next step boundary, or when the attempt closes (after waiting, bounded, for its last
checkpoint's commit). Rows whose commit this attempt never heard of stay in its next
checkpoint's buffer, and the attempt that resumes from that checkpoint writes them
(`resumed`). Only rank 0 writes: its metrics are the run's.

A tracker that cannot be reached never stops training: the rows stay buffered (and
checkpointed) and are written by a later flush, with a line in the run's log.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from baton.tracking import identity
from baton.tracking.rows import Rows
from baton.tracking.sinks import Sink, open_sink, summary_writer
from shared.contracts.tracking import Tracking

CLOSE_WAIT_S = 30.0
"""How long a closing attempt waits to hear its last checkpoint committed; past it, its
rows are left to the checkpoint (and so to the attempt that resumes from it)."""
ASK_S = 2.0
"""How long a closing attempt waits for the trainer's word before it looks in the store."""


def prepare(tracking: Tracking, run_id: str, rank: int) -> None:
    """Set this training process's environment for the run's tracker, before the user's
    code is loaded (`identity.environment`). For MLflow, rank 0 finds or creates the
    tracker run first, so `MLFLOW_RUN_ID` names it."""
    mlflow_id = None
    if tracking.kind == "mlflow" and rank == 0:
        from baton.tracking.sinks import mlflow_run

        try:
            mlflow_id = mlflow_run(tracking, run_id)
        except Exception as exc:
            print(f"baton: tracking: cannot reach MLflow at {tracking.uri}: {exc}", file=sys.stderr)
    os.environ.update(identity.environment(tracking, run_id, mlflow_id))


class Tracker:
    def __init__(self, tracking: Tracking, run_id: str, rank: int) -> None:
        self.config = tracking
        self.log_dir = identity.log_dir(tracking, run_id)
        """TensorBoard's dir of this run, for the user's own writer (Baton's own metrics
        go to its `baton` folder)."""
        self.purge_step: int | None = None
        """The step this attempt resumed at (0 for a fresh start), set by `restore()`:
        what a `SummaryWriter` of the user's opens with, so that TensorBoard drops what
        earlier attempts logged at this step or later (`summary_writer()` does it)."""
        self.rows = Rows()
        self.step_base = 0
        """The number the first step is written under: 0, as `ctx.steps()` yields it, or
        1 in a framework's loop, whose global step counts the steps done
        (`baton.runtime.external`). A checkpoint at step `c` keeps the rows before
        `c + step_base`."""
        self._writes = rank == 0
        """Only rank 0's metrics are the run's."""
        self._sink: Sink | None = None
        self._done = threading.Condition()
        self._committed = -1
        self._flushed = -1
        self._warned = False

    # -- the user's side -----------------------------------------------------------------

    def summary_writer(self, *, first_step: int = 0, **kwargs: Any) -> Any:
        """A TensorBoard `SummaryWriter` on the run's log dir, opened with `purge_step`, so
        steps this attempt redoes replace what a killed attempt logged of them. Steps are
        numbered as `ctx.steps()` yields them; a writer numbering from 1 (a framework's
        global step, the Hugging Face Trainer's) gives `first_step=1`."""
        if self.purge_step is None:
            raise RuntimeError("call ctx.restore(...) first: it finds the step to purge from")
        return summary_writer(self.log_dir, self.purge_step + first_step, **kwargs)

    # -- Baton's side --------------------------------------------------------------------

    def resumed(self, step: int, kept: int) -> None:
        """The attempt resumed at `step`; `rows` holds what its checkpoint brought back, of
        which the steps before `kept` (the newest committed checkpoint's step) are kept: a
        host's local snapshot (`baton.runtime.local`) resumes ahead of any commit, and its
        rows past the commit wait for one of this attempt's."""
        self.purge_step = step
        if not self._writes:
            return
        restored = self.rows.kept(kept + self.step_base)
        try:
            self._sink = open_sink(self.config, self.log_dir, os.environ.get("MLFLOW_RUN_ID"))
            if self._sink is not None:
                self.rows.written(self._sink.resumed(kept + self.step_base, restored))
                self._flushed = kept
        except Exception as exc:
            self._sink = None
            self._warn(exc)

    def stepped(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (numbered from `step_base`) reported `metrics`."""
        if self._writes and metrics:
            self.rows.stepped(step, int(time.time() * 1000), metrics)

    def committed(self, step: int) -> None:
        """The attempt's checkpoint at `step` committed (the trainer said so)."""
        with self._done:
            self._committed = max(self._committed, step)
            self._done.notify_all()

    def flush(self) -> None:
        """Write the rows kept by the newest commit heard of; on the training thread."""
        with self._done:
            committed = self._committed
        if self._sink is None or committed <= self._flushed:
            return
        try:
            rows = self.rows.kept(committed + self.step_base)
            self.rows.written(self._sink.write(rows))
            self._flushed = committed
        except Exception as exc:
            self._warn(exc)

    def close(self, saved: int, completed: bool, in_store: Callable[[], int]) -> None:
        """The attempt ends after its checkpoint at `saved`: wait for its commit — told by
        the trainer, or seen in the store (`in_store`: the step of the newest commit of this
        attempt there) when the trainer's word does not come — then flush."""
        if self._sink is None:
            return
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            with self._done:
                if self._done.wait_for(lambda: self._committed >= saved, min(left, ASK_S)):
                    break
            if (seen := in_store()) >= saved:
                self.committed(seen)
                break
        self.flush()
        try:
            self._sink.close(completed and self._flushed >= saved)
        except Exception as exc:
            self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            print(f"baton: tracking: {self.config.kind}: {exc!r}; its rows stay buffered and"
                  " checkpointed until it can be written to", file=sys.stderr)  # fmt: skip
