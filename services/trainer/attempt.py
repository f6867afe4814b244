"""One training attempt: a lease held, a child process running, its commits followed.

An attempt ends in exactly one outcome; only the trainer's loop turns it into an answer to
the task message:

    COMPLETED  final checkpoint committed, run record COMPLETED      -> ack
    CANCELLED  checkpoint committed, run record CANCELLED            -> ack
    STOPPED    the run ended elsewhere (hard timeout): child killed   -> ack
    PREEMPTED  stopped on SIGTERM, checkpoint committed, lease freed  -> nak(0): next worker now
    RETRY      user code failed (or stalled), retries left            -> nak(back-off)
    FAILED     user code failed for good, run record FAILED           -> ack
    FENCED     someone else holds the run now                         -> nothing: the message is
               no longer ours, and a late ack could delete the new holder's copy (docs/nats.md)

Each attempt is an `attempt` span, continuing the trace whose context the task message's
headers carry (the dispatch), and the parent of the attempt's `commit` spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import Error as JetStreamError
from opentelemetry import trace

from services.trainer.child_proc import Child
from services.trainer.commits import Commits
from services.trainer.keeper import Keeper
from shared import telemetry
from shared.bus import names
from shared.bus.emit import emit
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, Task
from shared.contracts.child import (
    EXIT_BAD_LAUNCH,
    CheckpointReady,
    Control,
    Divergence,
    Finished,
    Launch,
    Loaded,
    StepDone,
)
from shared.contracts.events import (
    AttemptFailed,
    Cancelled,
    Completed,
    Diverged,
    Event,
    Failed,
    Fenced,
    Preempted,
    Progress,
    Restored,
    Started,
)
from shared.state.lease import Lease
from shared.state.pools import Pools
from shared.state.runs import Change, Runs

log = logging.getLogger("baton.trainer")

FINAL_COMMIT_WAIT_S = 900.0
LOG_TAIL_BYTES = 3000


class Outcome(enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    RETRY = "retry"
    FAILED = "failed"
    FENCED = "fenced"


class Attempt:
    def __init__(
        self,
        nc: Client,
        settings: Settings,
        store: Store,
        runs: Runs,
        pools: Pools,
        task: Task,
        lease: Lease,
        child: Child,
        signals: tuple[asyncio.Event, asyncio.Event],
        beat_now: asyncio.Event,
    ) -> None:
        self.js: JetStreamContext = nc.jetstream()
        self.nc = nc
        self.settings = settings
        self.store = store
        self.runs = runs
        self.pools = pools
        self.task = task
        self.run_id = task.run_id
        self.lease = lease
        self.child = child
        self.stop, self.hurry = signals
        self.worker = settings.worker_id
        self.keeper = Keeper(task.run_id, lease, runs, store, beat_now, child.send)
        self.orders = self.keeper.orders
        self.site = settings.site
        self.commits = Commits(
            self.js, store, runs, task.run_id, self.worker, lambda: lease.token,
            task.spec.checkpoint.keep_last, task.spec.pool, self.site,
        )  # fmt: skip
        self.step = 0
        self.start_step = 0
        self.retry_delay = 0.0
        self.log_path = Path(settings.work_dir) / "logs" / f"{self.run_id}.log"
        self.last_checkpoint: CheckpointReady | None = None
        self._began = time.monotonic()
        self._keeping: asyncio.Task[None]
        self._last_progress = 0.0
        self._rate: tuple[float, int] | None = None
        self._metric_attrs = {telemetry.POOL: task.spec.pool}
        self._recovering = False
        """Set for an attempt after the run's first, until its first step is done."""

    async def run(self, msg: Msg) -> Outcome:
        """Run the attempt for the task message `msg`: its `in_progress` keeps it ours, and
        its headers carry the run's trace context."""
        touch = msg.in_progress
        with telemetry.tracer.start_as_current_span(
            "attempt",
            context=telemetry.extract(msg.headers),
            kind=trace.SpanKind.CONSUMER,
            attributes={
                telemetry.RUN_ID: self.run_id,
                telemetry.WORKER: self.worker,
                telemetry.TOKEN: self.lease.token,
                telemetry.POOL: self.task.spec.pool,
            },
        ) as span:
            self.commits.trace_context = trace.set_span_in_context(span)
            try:
                outcome = await self._run(touch, span)
            finally:
                self.commits.close()
            span.set_attribute(telemetry.OUTCOME, outcome.value)
            return outcome

    async def _run(self, touch: Callable[[], Awaitable[None]], span: trace.Span) -> Outcome:
        token = self.lease.token
        record = await self.runs.update(self.run_id, self._mark_running)
        if record is None:
            found = await self.runs.get(self.run_id)
            terminal = found is not None and found[0].state.terminal
            return Outcome.STOPPED if terminal else Outcome.FENCED
        latest = await commit.read_latest(self.store, self.run_id)
        self.step = self.start_step = latest[0].step if latest else 0
        span.set_attributes({telemetry.ATTEMPT: record.attempts, telemetry.START_STEP: self.step})
        self._recovering = record.attempts > 1
        started = Started(
            run_id=self.run_id, worker=self.worker, token=token,
            attempt=record.attempts, start_step=self.step,
        )  # fmt: skip
        await self._emit(started)
        log.info(
            "%s: attempt %d from step %d, token %d", self.run_id, record.attempts, self.step, token
        )
        sub = await self.nc.subscribe(
            names.at_site(names.events_of_run(self.run_id), self.site), cb=self.commits.on_event
        )
        launch = Launch(task=self.task, token=token, worker=self.worker, store_url=self.store.url)
        self.child.send(launch)
        self._keeping = asyncio.create_task(self.keeper.keep(touch))
        background = [
            self._keeping,
            asyncio.create_task(self.child.copy_output(self.log_path, self._publish_output)),
        ]
        try:
            return await self._follow()
        finally:
            self.child.kill()
            await self.child.wait()
            for t in background:
                t.cancel()
            # Wait for them to end, so that nothing of this attempt (a lease renewal above
            # all) still runs when the trainer answers the task and frees the lease.
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _publish_output(self, chunk: bytes) -> None:
        # The captured output goes to the run's log stream for `baton logs`; it is best
        # effort (the local log file keeps everything), so a down link skips chunks.
        with contextlib.suppress(Exception):
            subject = names.at_site(names.logs_subject(self.run_id), self.site)
            await self.js.publish(subject, chunk, timeout=2)

    async def _release(self) -> None:
        """Stop keeping the lease, then give it up. In that order: a keeper beat after the
        release would find the lease free and take it again, and the next worker would
        wait out the TTL."""
        self._keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeping
        await self.lease.release()

    async def _emit(self, event: Event, *, msg_id: str | None = None, attempts: int = 0) -> None:
        await emit(self.js, event, msg_id=msg_id, attempts=attempts, site=self.site)

    def orphaned(self, reason: str) -> None:
        """The reaper saw this worker run a run it does not hold: stop at once."""
        self.orders.fence(f"orphan: {reason}")

    # -- the attempt's course ------------------------------------------------------------

    async def _follow(self) -> Outcome:
        o = self.orders
        reader = asyncio.create_task(self._read())
        watch = [asyncio.create_task(e.wait()) for e in (o.fenced, o.halt, o.cancel, self.stop)]
        try:
            await asyncio.wait({reader, *watch}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done() and not (o.fenced.is_set() or o.halt.is_set()):
                why = "cancelled" if o.cancel.is_set() else "preempted"
                log.info("%s: %s at step %d; checkpointing", self.run_id, why, self.step)
                self.child.send(Control(action="stop"))
                hurry = asyncio.create_task(self.hurry.wait())
                await asyncio.wait(
                    {reader, watch[0], watch[1], hurry},
                    timeout=self.settings.grace_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                hurry.cancel()
            if o.fenced.is_set():
                return await self._on_fenced()
            if o.halt.is_set():
                self.child.kill()
                if o.halt_is_stall:
                    return await self._on_child_failed(-9, o.reason)
                log.warning("%s: stopped: %s", self.run_id, o.reason)
                return Outcome.STOPPED
            if not reader.done():  # grace ran out, or a second signal
                self.child.kill()
                return await self._on_stopped_early(None)
            finished = reader.result()
            if finished is None:
                return await self._on_child_failed(await self.child.wait())
            # `Finished` comes after the child's last write, so its exit (a second or so of
            # interpreter teardown) is not waited for: the next worker would wait with us.
            if finished.stopped:
                return await self._on_stopped_early(finished)
            return await self._on_finished()
        finally:
            for t in (reader, *watch):
                t.cancel()

    async def _read(self) -> Finished | None:
        async for msg in self.child.messages():
            if isinstance(msg, Loaded):
                self.step = msg.step
                restored = Restored(
                    run_id=self.run_id, worker=self.worker, step=msg.step, damaged=msg.damaged
                )
                await self._emit(restored)
            elif isinstance(msg, StepDone):
                self.step = msg.step
                if self._recovering:
                    self._recovering = False
                    telemetry.RECOVERY.record(time.monotonic() - self._began, self._metric_attrs)
                await self._progress(msg)
            elif isinstance(msg, CheckpointReady):
                telemetry.CHECKPOINT_STALL.record(msg.stall_s, self._metric_attrs)
                size = sum(f.size for f in msg.files)
                telemetry.CHECKPOINT_BYTES.record(size, self._metric_attrs)
                await self.commits.request(msg)
                self.last_checkpoint = msg
            elif isinstance(msg, Divergence):
                log.warning(
                    "%s: not exact: %s at step %d was %s, now %s (resumed from %d)",
                    self.run_id, msg.metric, msg.step, msg.expected, msg.got, msg.checkpoint,
                )  # fmt: skip
                diverged = Diverged(
                    run_id=self.run_id, worker=self.worker, checkpoint=msg.checkpoint,
                    step=msg.step, metric=msg.metric, expected=msg.expected, got=msg.got,
                )  # fmt: skip
                await self._emit(diverged)
            elif isinstance(msg, Finished):
                return msg
        return None

    async def _on_finished(self) -> Outcome:
        final = self.last_checkpoint
        if final is None or not final.final:
            return await self._on_child_failed(
                0, "the entry point ended without its final checkpoint"
            )
        if not await self.commits.wait(final.token, final.step, FINAL_COMMIT_WAIT_S):
            self.orders.fence(f"final commit at step {final.step} was refused")
            return await self._on_fenced()
        done = self._spent(
            state=RunState.COMPLETED, step=final.step, digest=final.digest,
            metrics=final.metrics, worker=None, reason=None,
        )  # fmt: skip
        if await self._record_outcome(done) is None:
            self.orders.fence("the run record moved on")
            return await self._on_fenced()
        completed = Completed(
            run_id=self.run_id, step=final.step, digest=final.digest, metrics=final.metrics
        )
        await self._emit(completed, msg_id=f"completed.{self.run_id}")
        elapsed = time.monotonic() - self._began
        if final.step > self.start_step:
            with contextlib.suppress(Exception):  # a speed sample is not worth failing over
                await self.pools.record(
                    self.task.spec.pool, elapsed / (final.step - self.start_step)
                )
        log.info("%s: completed at step %d, digest %s", self.run_id, final.step, final.digest[:16])
        return Outcome.COMPLETED

    async def _on_stopped_early(self, finished: Finished | None) -> Outcome:
        """Preempted (SIGTERM) or cancelled: the child checkpointed and returned (or was
        killed when the grace ran out)."""
        last = self.last_checkpoint
        if finished is not None and last is not None:
            await self.commits.wait(last.token, last.step, self.settings.grace_s)
        step = last.step if last else 0
        if self.orders.cancel.is_set():
            reason = self.orders.reason
            cancelled = self._spent(state=RunState.CANCELLED, reason=reason, worker=None)
            if await self.runs.update(self.run_id, cancelled) is not None:
                await self._release()
                event = Cancelled(run_id=self.run_id, reason=reason)
                await self._emit(event, msg_id=f"cancelled.{self.run_id}")
                return Outcome.CANCELLED
        await self.runs.update(self.run_id, self._spent(worker=None))
        await self._release()
        await self._emit(Preempted(run_id=self.run_id, worker=self.worker, step=step))
        log.info("%s: preempted; lease released after step %d", self.run_id, step)
        return Outcome.PREEMPTED

    async def _on_fenced(self) -> Outcome:
        self.child.kill()
        reason = self.orders.reason or "lease lost"
        log.warning("%s: fenced (%s); training process killed", self.run_id, reason)
        trace.get_current_span().set_attribute("baton.reason", reason)
        fenced = Fenced(
            run_id=self.run_id, worker=self.worker, token=self.lease.token, reason=reason
        )
        await self._emit(fenced)
        return Outcome.FENCED

    async def _on_child_failed(self, code: int, why: str = "") -> Outcome:
        tail = _tail(self.log_path)
        reason = why or (
            "the entry point could not be loaded"
            if code == EXIT_BAD_LAUNCH
            else f"training process exited with code {code}"
        )
        token = self.lease.token
        spent = self._spent()
        trace.get_current_span().set_status(trace.StatusCode.ERROR, reason)

        def count(r: RunRecord) -> RunRecord | None:
            if r.state.terminal or r.token != token:
                return None
            retries = r.retries + 1
            give_up = code == EXIT_BAD_LAUNCH or retries > r.spec.limits.max_retries
            r = spent(r) or r
            return msgspec.structs.replace(
                r, retries=retries, stop_token=None, stop_reason=None,
                state=RunState.FAILED if give_up else r.state,
                reason=reason if give_up else r.reason,
            )  # fmt: skip

        record = await self.runs.update(self.run_id, count)
        if record is None:
            return await self._on_fenced()
        if record.state is RunState.FAILED:
            failed = Failed(run_id=self.run_id, reason=reason, detail=tail)
            await self._emit(failed, msg_id=f"failed.{self.run_id}")
            return Outcome.FAILED
        attempt_failed = AttemptFailed(
            run_id=self.run_id, worker=self.worker, attempt=record.attempts,
            reason=reason, detail=tail,
        )  # fmt: skip
        await self._emit(attempt_failed)
        await self._release()
        self.retry_delay = min(2.0**record.retries, 60.0)
        return Outcome.RETRY

    # -- helpers -------------------------------------------------------------------------

    async def _record_outcome(self, change: Change) -> RunRecord | None:
        """Write the run's outcome, however long the hub stays out of reach: the final
        checkpoint is committed (the store said so), and only the record is missing. At a
        site whose link is down this waits for the link; the keeper keeps the lease (or
        fences us, and then the record refuses the change)."""
        delay = 0.5
        while True:
            try:
                return await self.runs.update(self.run_id, change)
            except (TimeoutError, NatsTimeoutError, NoRespondersError, JetStreamError) as exc:
                if self.orders.fenced.is_set():
                    return None
                log.warning(
                    "%s: recording the outcome failed (%s); retrying", self.run_id,
                    type(exc).__name__,
                )  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _mark_running(self, r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.token or 0) > self.lease.token:
            return None
        return msgspec.structs.replace(
            r, state=RunState.RUNNING, worker=self.worker, token=self.lease.token,
            attempts=r.attempts + 1,
        )  # fmt: skip

    def _spent(self, **fields: object) -> Change:
        """A record change that also books this attempt's time and cost, applied only
        while the record still names our token."""
        elapsed = time.monotonic() - self._began
        cost = elapsed * self.pools.rate(self.task.spec.pool) / 3600
        token = self.lease.token

        def change(r: RunRecord) -> RunRecord | None:
            if r.state.terminal or r.token != token:
                return None
            return msgspec.structs.replace(
                r, busy_s=r.busy_s + elapsed, actual_cost=r.actual_cost + cost, **fields
            )

        return change

    async def _progress(self, msg: StepDone) -> None:
        now = time.monotonic()
        if self._rate is None:
            self._rate = (now, msg.step)
        last = msg.step >= self.task.spec.total_steps
        if now - self._last_progress < self.settings.progress_interval_s and not last:
            return
        t0, s0 = self._rate
        rate = (msg.step - s0) / (now - t0) if now > t0 else 0.0
        self._last_progress = now
        if now > t0:  # the first sample has no interval yet; a 0 would read as a stall
            attrs = {**self._metric_attrs, telemetry.WORKER: self.worker}
            telemetry.STEPS_PER_SECOND.set(rate, attrs)
        event = Progress(
            run_id=self.run_id, step=msg.step, total_steps=self.task.spec.total_steps,
            metrics=msg.metrics, steps_per_s=rate, worker=self.worker,
        )  # fmt: skip
        # Progress is best-effort: while a link is down the next one will do.
        with contextlib.suppress(Exception):
            await self._emit(event, attempts=1)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
