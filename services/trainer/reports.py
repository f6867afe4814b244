"""What an attempt tells the world as it goes: where it resumed, its progress, a resume that
was not exact, a stall and its end, a divergence the guard stopped, and the metrics of its
steps and checkpoints.

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
from shared.contracts.child import CheckpointReady, Divergence, Loaded, StepDone, Tripped
from shared.contracts.events import (
    Diverged,
    Event,
    Guarded,
    Progress,
    Restored,
    Round,
    RunWarning,
    StallRecovered,
)
from shared.contracts.rounds import RoundNote

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
            restore_s=msg.took_s, setup_s=msg.setup_s, resharded_from=msg.resharded_from,
            read_bytes=msg.read_bytes, local=msg.local,
        )  # fmt: skip
        await self.emit(restored)

    async def changed(self, msg: Loaded) -> None:
        """It resumed under other software than its checkpoint recorded, as allowed."""
        detail = f"resumed step {msg.step} under other software: {'; '.join(msg.changed)}"
        log.warning("%s: %s", self.run_id, detail)
        kind = "changed_since_checkpoint"
        await self.emit(RunWarning(run_id=self.run_id, kind=kind, detail=detail))

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

    async def round(self, note: RoundNote) -> None:
        """A replica's round boundary (`baton.runtime.replica`), as a `round` event."""
        if note.outcome == "waiting":
            return  # the outcome follows; the wait is told by its `waited_s`
        if note.outcome != "joined":
            log.info("%s: round boundary at step %d: %s %s", self.run_id, note.step,
                     note.outcome, note.detail)  # fmt: skip
        await self.emit(Round(run_id=self.run_id, worker=self.worker, note=note))

    async def stalled(self, quiet_s: float, step: int, bound_s: float) -> None:
        detail = (
            f"no step for {quiet_s:.0f}s after step {step} (a stall is {bound_s:.0f}s for this "
            "run); it is stopped if it does not step within half as long again"
        )
        log.warning("%s: stalled: %s", self.run_id, detail)
        await self.emit(RunWarning(run_id=self.run_id, kind="stalled", detail=detail))

    async def stall_recovered(self, quiet_s: float, step: int) -> None:
        log.info("%s: stepped again after %.0fs without a step", self.run_id, quiet_s)
        event = StallRecovered(run_id=self.run_id, worker=self.worker, step=step, quiet_s=quiet_s)
        await self.emit(event)

    async def guarded(self, t: Tripped, action: str, good_step: int) -> None:
        log.warning(
            "%s: divergence guard: step %d: %s = %s (%s%s); %s from step %d",
            self.run_id, t.step, t.metric, t.value, t.rule, f": {t.detail}" if t.detail else "",
            action, good_step,
        )  # fmt: skip
        event = Guarded(
            run_id=self.run_id, worker=self.worker, step=t.step, metric=t.metric,
            value=t.value, rule=t.rule, action=action, good_step=good_step,
        )  # fmt: skip
        await self.emit(event)

    async def stepped(self, msg: StepDone, newest: tuple[int, float]) -> None:
        """A step's report; `newest`: the newest committed checkpoint's step and when the
        training process reached it (`Commits.newest`)."""
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
        committed, reached = newest
        age, at_risk = now - reached, max(0, msg.step - committed)
        run = {**self.attrs, telemetry.RUN_ID: self.run_id}
        telemetry.CHECKPOINT_AGE.set(age, run)
        telemetry.STEPS_AT_RISK.set(at_risk, run)
        event = Progress(
            run_id=self.run_id, step=msg.step, total_steps=self.task.spec.total_steps,
            metrics=msg.metrics, steps_per_s=rate, worker=self.worker, stall_s=self.stall_s,
            checkpoint_age_s=age, steps_at_risk=at_risk,
        )  # fmt: skip
        with contextlib.suppress(Exception):
            await self.emit(event, attempts=1)
