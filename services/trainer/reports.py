"""What an attempt tells the world as it goes: where it resumed, its progress, a resume that
was not exact, and the metrics of its steps and checkpoints.

Progress is best effort and rate-limited (`BATON_PROGRESS_INTERVAL`): while a link is down
the next one will do. The events that matter for a run's history (`restored`, `diverged`)
are published with retries.
"""

from __future__ import annotations

import contextlib
import logging
import time

from nats.js import JetStreamContext

from shared import telemetry
from shared.bus.emit import emit
from shared.contracts import Task
from shared.contracts.child import CheckpointReady, Divergence, Loaded, StepDone
from shared.contracts.events import Diverged, Event, Progress, Restored

log = logging.getLogger("baton.trainer")


class Reports:
    def __init__(
        self,
        js: JetStreamContext,
        task: Task,
        worker: str,
        site: str,
        interval_s: float,
        began: float,
    ) -> None:
        self.js = js
        self.task = task
        self.run_id = task.run_id
        self.worker = worker
        self.site = site
        self.interval_s = interval_s
        self.began = began
        """When the attempt began (monotonic): recovery is measured from it."""
        self.recovering = False
        """Set for an attempt after the run's first, until its first step is done."""
        self.stall_s = 0.0
        """Seconds the training loop was blocked by this attempt's checkpoints so far."""
        self.attrs = {telemetry.POOL: task.spec.pool}
        self._last = 0.0
        self._rate: tuple[float, int] | None = None

    async def emit(self, event: Event, *, attempts: int = 0) -> None:
        await emit(self.js, event, attempts=attempts, site=self.site)

    async def restored(self, msg: Loaded) -> None:
        restored = Restored(
            run_id=self.run_id, worker=self.worker, step=msg.step, damaged=msg.damaged,
            restore_s=msg.took_s, setup_s=msg.setup_s,
        )  # fmt: skip
        await self.emit(restored)

    def checkpointed(self, msg: CheckpointReady) -> None:
        telemetry.CHECKPOINT_STALL.record(msg.stall_s, self.attrs)
        self.stall_s += msg.stall_s
        telemetry.CHECKPOINT_BYTES.record(sum(f.size for f in msg.files), self.attrs)

    async def diverged(self, msg: Divergence) -> None:
        log.warning(
            "%s: not exact: %s at step %d was %s, now %s (resumed from %d)",
            self.run_id, msg.metric, msg.step, msg.expected, msg.got, msg.checkpoint,
        )  # fmt: skip
        diverged = Diverged(
            run_id=self.run_id, worker=self.worker, checkpoint=msg.checkpoint,
            step=msg.step, metric=msg.metric, expected=msg.expected, got=msg.got,
        )  # fmt: skip
        await self.emit(diverged)

    async def stepped(self, msg: StepDone) -> None:
        now = time.monotonic()
        if self.recovering:
            self.recovering = False
            telemetry.RECOVERY.record(now - self.began, self.attrs)
        if self._rate is None:
            self._rate = (now, msg.step)
        last = msg.step >= self.task.spec.total_steps
        if now - self._last < self.interval_s and not last:
            return
        t0, s0 = self._rate
        rate = (msg.step - s0) / (now - t0) if now > t0 else 0.0
        self._last = now
        if now > t0:  # the first sample has no interval yet; a 0 would read as a stall
            telemetry.STEPS_PER_SECOND.set(rate, {**self.attrs, telemetry.WORKER: self.worker})
        event = Progress(
            run_id=self.run_id, step=msg.step, total_steps=self.task.spec.total_steps,
            metrics=msg.metrics, steps_per_s=rate, worker=self.worker, stall_s=self.stall_s,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            await self.emit(event, attempts=1)
