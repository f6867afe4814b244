"""What a run does between two steps, on every rank (`StepBoundary`, the half of
`RunContext` that does it): the step checked against the divergence guard and the witness,
its progress reported, the group agreeing whether to stop, a checkpoint taken when due — and
vetted on the writer thread before it is written."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from baton.runtime import guard, witness
from baton.runtime.checkpoints import Checkpoints
from baton.runtime.data import Batches
from baton.runtime.replica import Replica
from baton.runtime.snapshot import Snapshot
from shared.checkpoint import commit
from shared.contracts.child import Divergence, FromChild, StepDone, Tripped
from shared.contracts.records import Skip

if TYPE_CHECKING:  # a single-rank run never imports torch.distributed's machinery
    from baton.runtime.group import Group
    from baton.tracking.tracker import Tracker

REPORT_INTERVAL_S = 0.2


class StepBoundary:
    """The step boundary of a `RunContext`, which holds all of these."""

    run_id: str
    step: int
    total_steps: int
    token: int
    cursor: dict[str, Any]
    _group: Group | None
    _replica: Replica | None
    _checkpoints: Checkpoints
    _lock: threading.Lock
    _want_checkpoint: bool
    _want_stop: bool
    _agreed_stop: bool
    _last_report: float
    _send: Callable[[FromChild], None]
    _metrics: dict[str, float]
    _step_metrics: dict[str, float]
    _witness: witness.Witness
    _guard: guard.Watch
    _refused: Tripped | None
    _skips: list[Skip]
    _loaders: dict[str, Batches]
    tracking: Tracker | None

    def _after_step(self) -> None:
        self._check_step()
        last = self.step == self.total_steps
        if self._replica is not None and self._replica.due(self.step, last):
            self._progress(True)  # the step's report goes out before the round's wait
            self._replica.boundary(self.step, self.token, last, lambda: self._want_stop)
        if self._boundary():
            self._save(final=False)
        self._checkpoints.keep_local(self.step, self.cursor, self.token)

    def _boundary(self, report: bool = True) -> bool:
        """What every rank agrees on once a step is done (a stop is kept in `should_stop`);
        whether a checkpoint is due now. With `report`, the step's progress is sent too."""
        with self._lock:
            asked, self._want_checkpoint = self._want_checkpoint, False
            stop = self._want_stop
        save, stop = self._checkpoints.due(self.step, asked, stop)
        if self._group is not None:
            self._agreed_stop = stop
        if report:
            self._progress(save)
        return save

    def _progress(self, due: bool) -> None:
        """Tell the trainer the step is done, with the metrics so far: at most every
        `REPORT_INTERVAL_S`, and always when `due` (a checkpoint's step) and at the end."""
        now = time.monotonic()
        if due or now - self._last_report >= REPORT_INTERVAL_S or self.step == self.total_steps:
            self._last_report = now
            self._send(StepDone(step=self.step, metrics=dict(self._metrics)))

    def _save(self, final: bool) -> None:
        ckpt = self._checkpoints
        ckpt.raise_failed()
        if self.step == ckpt.last_saved and not final:
            return
        if ckpt.skip(self.step):
            return
        if not final:
            self._witness.checkpointed(self.step)
        began = time.perf_counter()
        taken = ckpt.state(self.step, self.cursor)
        ckpt.write(self.step, self.token, taken, final=final, metrics=self._metrics, began=began)

    def _check_step(self) -> None:
        """The step just done, against the divergence guard and the witness of the
        checkpoint it follows."""
        metrics, self._step_metrics = self._step_metrics, {}
        self._guarded(self._guard.stepped(self.step, metrics))
        self._witnessed(self.step, metrics)
        if self.tracking is not None:  # as the step was yielded; kept rows written
            self.tracking.stepped(self.step - 1, metrics)
            self.tracking.flush()

    def _guarded(self, tripped: Tripped | None) -> None:
        """End the attempt here if the guard tripped (`baton.runtime.guard`): at this step,
        or on a checkpoint the writer thread refused since (`_vet`). The host's local
        snapshots go with it: taken unvetted since the last checkpoint, they may hold the
        state that blew up, and the run must go on from what the guard let through."""
        with self._lock:
            refused = self._refused
        if tripped is None and refused is None:
            return
        self._checkpoints.drop_local()
        if tripped is not None:
            self._send(tripped)
            raise guard.GuardTripped(tripped)
        assert refused is not None
        raise guard.GuardTripped(refused)

    def _vet(self, snap: Snapshot) -> bool:
        """On the writer thread, before a checkpoint is written: its tensors are all finite
        (the guard's check of the host copies, off the training loop). A refused one is never
        written nor handed over for commit; the loop stops at its next step boundary."""
        tripped = self._guard.checked(snap.step, snap.groups)
        if tripped is None:
            return True
        self._send(tripped)
        with self._lock:
            self._refused = tripped
        return False

    def _skip_rolled_back(self) -> None:
        """Resuming where the guard rolled the run back to: leave out the batches of the
        steps that blew up (`shared.contracts.Skip`), from every data loader."""
        batches = sum(s.batches for s in self._skips if s.after == self.step)
        if batches:
            print(f"baton: leaving out {batches} batch(es) after step {self.step}, as the "
                  "divergence guard rolled the run back", file=sys.stderr)  # fmt: skip
            for loader in self._loaders.values():
                loader.skip(batches)

    def _witnessed(self, step: int, metrics: dict[str, float]) -> None:
        complete, diverged = self._witness.stepped(step, metrics)
        for start, rows in complete:
            key = commit.witness_key(self.run_id, start)
            self._checkpoints.write_witness(key, witness.encode(rows))
        if diverged is not None:
            self._send(
                Divergence(
                    checkpoint=diverged.checkpoint,
                    step=diverged.step,
                    metric=diverged.metric,
                    expected=repr(diverged.expected),
                    got=repr(diverged.got),
                )
            )
