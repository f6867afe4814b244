"""One training attempt: a lease held, a child process running, its commits followed.

An attempt ends in exactly one verdict, decided once by `decide.follow` from the first thing
to happen, strongest first (its table), and carried out by `verdicts.apply` while the lease
is still kept, so a record write that waits out an outage does not lose the run.

Before any of it, the store is asked whose run it is (`owner.py`): a run whose chain ends
in a final commit is COMPLETED from the store, another side's is YIELDED, and a token the
hub forgot it issued gives the task back under a new epoch — nothing trains.

Each attempt is an `attempt` span, continuing the trace whose context the task message's
headers carry (the dispatch), and the parent of the attempt's `commit` spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace

from services.trainer import decide, owner, rewind
from services.trainer.child_proc import OUTPUT_DRAIN_S, Child
from services.trainer.commits import Commits
from services.trainer.group import Leader
from services.trainer.keeper import Keeper, Order
from services.trainer.meter import Meter
from services.trainer.reports import Reports
from services.trainer.stall import Bounds, StallWatch
from services.trainer.verdicts import Outcome, Scope, Verdict, apply
from shared import telemetry
from shared.bus import names
from shared.bus.emit import emit
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.config import Settings
from shared.contracts import Pointer, RunRecord, Skip, Task
from shared.contracts.child import (
    CheckpointReady,
    Control,
    Divergence,
    Finished,
    Launch,
    Listening,
    Loaded,
    Rendezvous,
    RoundReached,
    StepDone,
    Tripped,
)
from shared.contracts.events import (
    Event,
    RunWarning,
    Started,
)
from shared.contracts.records import Stall
from shared.state import transitions
from shared.state.lease import Lease
from shared.state.pools import Pools
from shared.state.runs import Runs

log = logging.getLogger("baton.trainer")


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
        group: Leader | None = None,
        grant: Callable[[], Awaitable[str | None]] | None = None,
        *,
        device: str = "cpu",
        leaving: Callable[[], str] = lambda: "",
    ) -> None:
        """`runs` holds the run's record: the hub's, or a site's own for a run granted to
        it, whose `grant` the keeper checks with the hub while it can (`granted.py`).
        `leaving` says why the first of `signals` is set (a drain's reason)."""
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
        self.leaving = leaving
        self.worker = settings.worker_id
        self.group = group
        """Set when this attempt leads a group of several ranks (as rank 0)."""
        self.rank = 0 if group is not None else None
        # A group's epoch is the token its ranks were started with: a lapsed lease re-taken
        # under a new token would leave them writing under the old one, so it is fenced.
        self.keeper = Keeper(
            task.run_id, lease, runs, store, beat_now, child.send, may_retake=group is None,
            grant=grant, on_record=group.allow if group is not None else None,
        )  # fmt: skip
        self.device = device.partition(":")[0]
        """Its training processes' kind of device (`cpu`, `cuda`): what it is priced at."""
        self.orders = self.keeper.orders
        self.site = settings.site
        self.side = task.grant.site if task.grant is not None else ""
        """Whose attempt (and chain): the granted site's, "" a hub task wherever it trains."""
        self.commits = Commits(
            self.js, store, runs, task.run_id, self.worker, lambda: lease.token,
            task.spec.checkpoint.keep_last, task.spec.pool, self.site, self.side,
            ranks=task.spec.max_ranks, elastic=task.spec.elastic,
            trained_s=lambda: self.meter.trained_s() if self.meter is not None else 0.0,
        )  # fmt: skip
        self.commits.on_committed = lambda step: child.send(Control(action="committed", step=step))
        self.step = 0
        self.start_step = 0
        self.log_path = Path(settings.work_dir) / "logs" / f"{self.run_id}.log"
        self.last_checkpoint: CheckpointReady | None = None
        self._began = time.monotonic()
        self._keeping: asyncio.Task[None] | None = None
        self._copying: asyncio.Task[None] | None = None
        self.reports = Reports(
            self.js, task, self.worker, self.site, settings.progress_interval_s, self._began
        )
        self._delivery: str | None = None
        """The task delivery this attempt answers, written into the record for a hand-over."""
        self._watching: asyncio.Task[None] | None = None
        self.broken = group.broken if group is not None else asyncio.Event()
        limits = task.spec.limits
        self.stall = StallWatch(
            Bounds(
                settings.stall_factor, settings.stall_floor_s, settings.stall_first_s,
                limits.stall_timeout_s,
            )
        )  # fmt: skip
        self.stalled: Stall | None = None
        """The hang the stall watch stopped the training process for, if it did."""
        self.launched = False
        """The training process was sent its `Launch`, which it reads before any `Control`."""
        self.tripped: Tripped | None = None
        """What the divergence guard stopped the training process for, if it did."""
        self.skips: list[Skip] = []
        """The run's rolled-back data, as its record said when the attempt started."""
        self.grow_wanted = group.grow if group is not None else asyncio.Event()
        self.meter: Meter | None = None
        """The run's credits as it trains (`meter.py`), once its record is read."""

    @property
    def token(self) -> int:
        return self.lease.token

    async def run(self, msg: Msg) -> Outcome:
        """Run the attempt for the task message `msg` and answer it: its `in_progress` keeps
        it ours, and its headers carry the run's trace context."""
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
                outcome = await self._run(msg, span)
            finally:
                self.commits.close()
            span.set_attribute(telemetry.OUTCOME, outcome.value)
            return outcome

    async def _run(self, msg: Msg, span: trace.Span) -> Outcome:
        scope = Scope(
            self.js, self.runs, self.lease, msg, self.worker, self.site,
            stop_keeping=self._stop_keeping, give_up=self._give_up_writing,
        )  # fmt: skip
        token = self.lease.token
        self._delivery = msg.reply
        group = [self.worker, *(m.worker for m in self.group.members)] if self.group else []
        running = transitions.mark_running(self.worker, token, self._delivery, group, self.side)
        record = await self.runs.update(self.run_id, running)
        latest = await commit.read_latest(self.store, self.run_id)
        if (verdict := await self._not_to_train(record, latest)) is not None:
            return await apply(verdict, scope)
        assert record is not None
        latest = await rewind.prepare(self, msg, record, latest)
        self.step = self.start_step = latest[0].step if latest else 0
        # A rollback forgets the data left out after the checkpoints it abandons.
        self.skips = [s for s in record.skips if s.after <= self.step]
        self.keeper.checkpoints_served = record.checkpoints_asked  # asked of attempts before
        if record.stall is not None:  # it hung before: its step time is known
            self.stall.knowing(record.stall.step_s)
        span.set_attributes({telemetry.ATTEMPT: record.attempts, telemetry.START_STEP: self.step})
        self.reports.recovering = record.attempts > 1
        ranks = self.group.ranks if self.group is not None else 1
        self.meter = meter = Meter(record, self.device, ranks)
        started = Started(
            run_id=self.run_id, worker=self.worker, token=token,
            attempt=record.attempts, start_step=self.step, device=self.device,
            ranks=self.group.ranks if self.group is not None else 1,
        )  # fmt: skip
        await self._emit(started)
        if self.group is not None and (resized := self.group.resized(self.step)) is not None:
            await self._emit(resized)
        log.info(
            "%s: attempt %d from step %d, token %d", self.run_id, record.attempts, self.step, token
        )
        sub = await self.nc.subscribe(
            names.at_site(names.events_of_run(self.run_id), self.site), cb=self.commits.on_event
        )
        rendezvous = None
        if self.group is not None:
            rendezvous = Rendezvous(
                epoch=token, rank=0, world_size=self.group.ranks, addr=self.group.key.addr,
                timeout_s=self.task.spec.collective_timeout_s,
            )  # fmt: skip
        launch = Launch(
            task=self.task, token=token, worker=self.worker, store_url=self.store.url,
            group=rendezvous, skips=self.skips, allow_changes=record.changes_allowed,
        )  # fmt: skip
        self.child.send(launch)
        self.launched = True
        if self.group is not None:
            self._watching = asyncio.create_task(self.group.watch())
        keeping = self._keeping = asyncio.create_task(self.keeper.keep(msg.in_progress))
        copying = self._copying = asyncio.create_task(
            self.child.copy_output(self.log_path, self._publish_output)
        )
        stalling = asyncio.create_task(
            self.stall.watch(self._stalled, self.reports.stall_recovered, self._stopped_stalling)
        )
        metering = asyncio.create_task(meter.watch(self._out_of_credits, self._short_of_credits))
        background = [keeping, copying, stalling, metering]
        try:
            verdict = await decide.follow(self)
            self.keeper.settling()
            outcome = await apply(verdict, scope)
            if outcome is Outcome.COMPLETED:
                await self._sample_speed()
            return outcome
        finally:
            self.child.kill()
            await self.child.wait()
            if self._watching is not None:
                background.append(self._watching)
            for t in background:
                t.cancel()
            if self.group is not None:
                await self.group.end()
            # Wait for them to end, so that nothing of this attempt (a lease renewal above
            # all) still runs after it.
            await asyncio.gather(*background, return_exceptions=True)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _not_to_train(
        self, record: RunRecord | None, latest: tuple[Pointer, str] | None
    ) -> Verdict | None:
        """The verdict of an attempt that must not train: its record refused it (the run is
        over, or someone newer holds it), or the store says the run is not its to train
        (`owner.py`); None when it may."""
        if record is None:
            return Verdict(Outcome.FENCED, change=transitions.unchanged, quiet=True)
        return await owner.before_training(self, latest[0] if latest else None)

    async def _publish_output(self, chunk: bytes) -> None:
        # The captured output goes to the run's log stream for `baton logs`; it is best
        # effort (the local log file keeps everything), so a down link skips chunks.
        with contextlib.suppress(Exception):
            subject = names.at_site(names.logs_subject(self.run_id), self.site)
            await self.js.publish(subject, chunk, timeout=2)

    def _give_up_writing(self) -> bool:
        """Stop retrying the verdict's record write through an outage once it no longer
        matters (fenced: the run is someone else's) or may not take longer (a second
        signal: the host is going away, and the run is recovered as a dead trainer's is)."""
        return self.orders.fenced or self.hurry.is_set()

    async def output_copied(self) -> None:
        """Until the exited child's last output is in its log file (the tail a failure
        reports), or a moment has passed: a grandchild holding the pipe open must not keep
        the verdict waiting."""
        if self._copying is not None:
            await asyncio.wait({self._copying}, timeout=OUTPUT_DRAIN_S)

    async def _stop_keeping(self) -> None:
        if self._keeping is None:  # the attempt never started
            return
        self._keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._keeping

    async def _emit(self, event: Event) -> None:
        await self.reports.emit(event)

    @property
    def growing(self) -> bool:
        """Stopping only because a trainer is free to grow this elastic group onto."""
        return self.grow_wanted.is_set() and not self.stop.is_set() and self.orders.given is None

    async def _stalled(self, quiet_s: float, step: int) -> None:
        await self.reports.stalled(quiet_s, step, self.stall.bound())

    def _stopped_stalling(self, quiet_s: float, step: int) -> None:
        self.stalled = Stall(step=step, step_s=self.stall.step_s())
        reason = f"stalled: no step for {quiet_s:.0f}s after step {step}"
        log.warning("%s: %s; stopping the training process", self.run_id, reason)
        self.orders.give(Order.STALL, reason)

    def orphaned(self, reason: str) -> None:
        """The reaper saw this worker run a run it does not hold: stop at once."""
        self.orders.fence(f"orphan: {reason}")

    async def read_child(self) -> Finished | None:
        """The training process's messages, acted on, until it says it finished (None: its
        output ended without that)."""
        async for msg in self.child.messages():
            if isinstance(msg, Loaded):
                await self._loaded(msg)
            elif isinstance(msg, StepDone):
                self.step = msg.step
                self.stall.stepped(msg.step, last=msg.step >= self.task.spec.total_steps)
                self.commits.reached(msg.step)
                await self.reports.stepped(msg, self.commits.newest)
            elif isinstance(msg, CheckpointReady):
                self.reports.checkpointed(msg)
                await self.commits.request(msg)
                self.last_checkpoint = msg
            elif isinstance(msg, Divergence):
                await self.reports.diverged(msg)
            elif isinstance(msg, RoundReached):
                self.stall.hold(msg.note.outcome == "waiting")  # a round's wait is no stall
                await self.reports.round(msg.note)
            elif isinstance(msg, Tripped):
                self.tripped = msg
            elif isinstance(msg, Listening) and self.group is not None:
                await self.group.go(msg.port)
            elif isinstance(msg, Finished):
                return msg
        return None

    async def _loaded(self, msg: Loaded) -> None:
        """The training process restored its checkpoint (step 0: none): it trains from here."""
        if self.meter is not None:
            self.meter.start()
        self.step = msg.step
        self.stall.stepped(msg.step)
        self.commits.resumed(msg.step)
        await self.reports.restored(msg)
        if msg.changed:
            await self.reports.changed(msg)
            await self.runs.update(self.run_id, transitions.note_changed(self.token, msg.changed))

    # -- helpers -------------------------------------------------------------------------

    async def _sample_speed(self) -> None:
        final = self.last_checkpoint
        if final is None or final.step <= self.start_step:
            return
        elapsed = time.monotonic() - self._began
        with contextlib.suppress(Exception):  # a speed sample is not worth failing over
            speed = elapsed / (final.step - self.start_step)
            await self.pools.record(self.task.spec.pool, speed, self.task.spec.name)

    def spent(self, *, own_failure: bool = False) -> transitions.Spent:
        """This attempt's time and cost so far, and its token: what its verdict's record
        change books (`transitions.book_time`), only while the record still names it. Its
        metered trainer-seconds are those it trained, or all of it for a failure of the
        run's own code (`meter.py`)."""
        elapsed = time.monotonic() - self._began
        cost = elapsed * self.pools.rate(self.task.spec.pool) / 3600
        meter = self.meter
        ranks = meter.ranks if meter is not None else 1
        metered = elapsed * ranks if own_failure else (meter.trained_s() if meter else 0.0)
        return transitions.Spent(self.lease.token, elapsed, cost, metered)

    def _out_of_credits(self, reason: str) -> None:
        log.warning("%s: %s; pausing at the next checkpoint", self.run_id, reason)
        self.orders.give(Order.PAUSE, reason)

    async def _short_of_credits(self, detail: str) -> None:
        warning = RunWarning(run_id=self.run_id, kind="credits_80", detail=detail)
        msg_id = f"warning.{self.run_id}.credits_80.{self.token}"
        await emit(self.js, warning, site=self.site, msg_id=msg_id)
