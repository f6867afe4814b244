"""The reaper's sweeps, one method each (the table in `service.py` says what each finds and
does), and what they share: ending a run, warning of it once, dispatching it again, a
command to a worker. `Sweeps` is the half of the reaper (`service.Reaper`) that does them."""

from __future__ import annotations

import contextlib
import logging
import time

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.reaper import budgets
from services.reaper.accounts import Accounts
from services.reaper.billing import billable
from services.reaper.clock import HubClock
from services.reaper.departures import Departures
from services.reaper.lapses import Lapses
from services.reaper.revocations import Revocations
from services.reaper.silences import Silences
from services.reaper.sites import SiteWatch
from shared.bus import names
from shared.bus.emit import emit
from shared.checkpoint import retention
from shared.checkpoint.store import Store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, encode
from shared.contracts.control import Command, WorkerInfo
from shared.contracts.events import Redispatched, RunWarning
from shared.state import transitions
from shared.state.endings import repair, settle
from shared.state.lease import holder as lease_holder
from shared.state.lease import lease_key
from shared.state.policy import Policy
from shared.state.runs import Runs, Stamped
from shared.state.tasks import publish_task

log = logging.getLogger("baton.reaper")


class Sweeps:
    """The sweeps of a reaper (`service.Reaper`), which holds all of these."""

    nc: Client
    js: JetStreamContext
    settings: Settings
    _unowned_since: dict[str, float]
    _unqueued_since: dict[str, float]
    _pending_since: dict[str, float]
    _recordless_since: dict[str, float]
    _orphan_seen: set[tuple[str, str]]
    _last_gc: float
    _seen: retention.Sightings
    clock: HubClock
    store: Store
    runs: Runs
    lapses: Lapses
    revocations: Revocations
    silences: Silences | None
    departures: Departures | None
    sites: SiteWatch
    lease_secret: bytes | None
    accounts: Accounts
    policy: Policy

    async def _timeouts(self, r: RunRecord) -> bool:
        """Each limit is the dispatcher's `…deadline_at − created_at` (one host's two
        times); how long the run has been going is the hub server's to say (`clock.py`)."""
        if r.deadline_at is None and (r.soft_deadline_at is None or "soft_timeout" in r.warned):
            return False
        elapsed = await self.clock.running_for(r)
        if r.deadline_at is not None and elapsed > r.deadline_at - r.created_at:
            limit = r.deadline_at - r.created_at
            reason = f"hard_timeout: not finished within {limit:.0f}s"
            await self._end(r, RunState.FAILED, reason)
            return True
        if r.soft_deadline_at is not None and elapsed > r.soft_deadline_at - r.created_at:
            detail = f"running past its soft timeout of {r.soft_deadline_at - r.created_at:.0f}s"
            await self._warn_once(r, "soft_timeout", detail)
        return False

    async def _queued_again(self, r: RunRecord) -> bool:
        """A live run that no trainer holds and no task stands for: its task again."""
        if r.state is RunState.RUNNING:
            return await self._lost(r)
        if r.state is RunState.QUEUED and r.admitted:
            return await self._unqueued(r)
        return False

    async def _lost(self, r: RunRecord) -> bool:
        key = lease_key(r.run_id, self.lease_secret)
        if await lease_holder(self.js, key) is not None or await self._task_queued(r):
            self._unowned_since.pop(r.run_id, None)
            return False
        now = time.monotonic()
        since = self._unowned_since.setdefault(r.run_id, now)
        if now - since < self.settings.lease_ttl_s:
            return False
        self._unowned_since.pop(r.run_id, None)
        if r.cancel_requested is not None:
            await self._end(r, RunState.CANCELLED, r.cancel_requested)
            return False
        if r.pause_requested is not None:
            await self.runs.update(r.run_id, transitions.pause_unowned)
            return False
        return await self._redispatch(r)

    async def _unqueued(self, r: RunRecord) -> bool:
        if await self._task_queued(r):
            self._unqueued_since.pop(r.run_id, None)
            return False
        now = time.monotonic()
        if now - self._unqueued_since.setdefault(r.run_id, now) < self.settings.lease_ttl_s:
            return False
        self._unqueued_since.pop(r.run_id, None)
        found = await self.runs.get(r.run_id)  # still so, at the dispatch the sweep read?
        if found is None:
            return False
        record = found[0]
        if record.state is not RunState.QUEUED or not record.admitted:
            return False
        if record.dispatch != r.dispatch or await self._task_queued(record):
            return False
        await publish_task(self.js, record, self.lease_secret)
        log.warning("%s: admitted, but no task was queued for it; queued now (#%d)",
                    record.run_id, record.dispatch)  # fmt: skip
        return True

    async def _orphans(self, workers: dict[str, WorkerInfo]) -> None:
        """A worker whose heartbeat names a run it does not hold, on two sweeps in a row
        (one could catch a hand-over half done), gets a kill command for that run."""
        seen = set()
        for w in workers.values():
            if w.run_id is None:
                continue
            holder = await lease_holder(self.js, lease_key(w.run_id, self.lease_secret))
            found = await self.runs.get(w.run_id)
            over = found is not None and found[0].state.terminal
            # A rank of a group runs the run under its leader's lease (`group[0]`).
            group = found[0].group if found is not None else []
            member = holder in group[:1] and w.worker in group
            if (holder is not None and holder != w.worker and not member) or over:
                key = (w.worker, w.run_id)
                seen.add(key)
                if key in self._orphan_seen:
                    why = f"{w.worker} runs {w.run_id} but " + (
                        "the run is over" if over else f"{holder} holds its lease"
                    )
                    log.warning("orphan: %s; sending a kill command", why)
                    await self._command(
                        w.worker, Command(run_id=w.run_id, action="kill", reason=why)
                    )
        self._orphan_seen = seen

    async def _announce(self, pending: list[RunRecord]) -> None:
        """Terminal records still waiting for their event: the writer died (or lost the
        link) between the record and the event. Its own publish may still be under way, so a
        record is repaired only after it stayed pending for a whole lease TTL, and one that a
        site ended only once that site's events have all arrived (its own copy may be
        waiting in its outbox)."""
        now = time.monotonic()
        seen = {r.run_id for r in pending}
        for run_id in [k for k in self._pending_since if k not in seen]:
            del self._pending_since[run_id]
        for r in pending:
            since = self._pending_since.setdefault(r.run_id, now)
            if now - since < self.settings.lease_ttl_s:
                continue
            if r.ending_site and not await self.sites.caught_up(r.ending_site):
                continue
            await repair(self.js, self.runs, r)
            self._pending_since.pop(r.run_id, None)

    async def _retire(self, live: list[tuple[str, Stamped | None]]) -> None:
        """Runs over for `BATON_GC_AGE` whose terminal event is stored leave the live index:
        their last uncommitted files are collected, their record archived (`Runs.retire`).
        Not sooner, because until then a fenced zombie's upload may still land, and the
        garbage sweep finds a run's files only while the run is live. How long it has been
        over is the hub server's stamp of its last revision against the server's clock now
        (`updated_at` is its writer's clock). A live key without a record for a whole lease
        TTL is a submission that died between its two writes; its redelivery writes it
        again."""
        now = time.monotonic()
        for run_id, found in live:
            if found is None:
                since = self._recordless_since.setdefault(run_id, now)
                if now - since >= self.settings.lease_ttl_s:
                    await self.runs.forget_live(run_id)
                    del self._recordless_since[run_id]
                continue
            self._recordless_since.pop(run_id, None)
            record, revision, written = found
            if not record.state.terminal or record.announce_pending or billable(record):
                continue
            if await self.clock.now() - written < self.settings.gc_age_s:
                continue
            try:
                await retention.collect_garbage(self.store, run_id, 0.0, self._seen)
            except Exception as exc:  # the store is down: retire it on a later sweep
                log.warning("%s: not retired yet, its store is unreachable: %r", run_id, exc)
                continue
            if await self.runs.retire(record, revision, self.settings.retain_ended_s):
                self._seen.forget(run_id)
                log.debug("%s: retired (%s)", run_id, record.state.value)

    async def _garbage(self, records: list[RunRecord]) -> None:
        """Checkpoint files of the runs in the live index that were never committed (a
        fenced zombie's, a crashed upload's) and are older than `BATON_GC_AGE`. Not every
        sweep: it lists the store. An ended run's are collected once more as it retires. An
        object's age is how long this reaper has seen it (`retention.Sightings`): whose clock
        stamped its last-modified time (the uploading trainer's, the store's) plays no part."""
        now = time.monotonic()
        if now - self._last_gc < min(300.0, max(self.settings.sweep_s, self.settings.gc_age_s / 4)):
            return
        self._last_gc = now
        for r in records:
            deleted = await retention.collect_garbage(
                self.store, r.run_id, self.settings.gc_age_s, self._seen
            )
            if deleted:
                log.info("%s: removed %d uncommitted objects", r.run_id, len(deleted))

    async def _end(self, r: RunRecord, state: RunState, reason: str) -> None:
        if await settle(self.js, self.runs, r.run_id, transitions.end(state, reason)) is None:
            return  # someone else ended it first
        if r.worker:  # its trainer reads the record at once and stops the child
            await self._command(r.worker, Command(run_id=r.run_id, action="wake", reason=reason))
        with contextlib.suppress(NotFoundError):
            queued = await self.js.get_last_msg(
                names.TASKS_STREAM, names.task_subject(r.spec.pool, r.run_id)
            )
            if r.state is RunState.QUEUED and queued.seq is not None:
                await self.js.delete_msg(names.TASKS_STREAM, queued.seq)
        log.warning("%s: %s (%s)", r.run_id, state.value, reason)

    async def _budget(self, r: RunRecord) -> None:
        """A run with `limits.max_cost` is warned once at each quarter of it its spend
        reaches: what its attempts booked plus the running one's seconds, on the hub
        server's clock, at its pool's rate (`budgets.py`)."""
        limit = r.spec.limits.max_cost
        if limit is None or all(kind in r.warned for kind in budgets.KINDS):
            return
        rate = self.policy.table.pool(r.spec.pool).rate_per_hour
        running_s = 0.0
        if r.state is RunState.RUNNING and rate > 0:
            started = await budgets.started_at(self.js, r)
            running_s = await self.clock.now() - started if started is not None else 0.0
        spent = budgets.spend(r.actual_cost, running_s, rate)
        for kind in budgets.crossed(spent, limit):
            detail = budgets.detail(spent, limit, r.actual_cost, running_s, rate)
            await self._warn_once(r, kind, detail)

    async def _warn_once(self, r: RunRecord, kind: str, detail: str) -> None:
        if kind in r.warned:
            return
        changed = await self.runs.update(r.run_id, transitions.warn(kind))
        if changed is not None:
            warning = RunWarning(run_id=r.run_id, kind=kind, detail=detail)
            await emit(self.js, warning, msg_id=f"warning.{r.run_id}.{kind}")

    async def _redispatch(self, seen: RunRecord) -> bool:
        record = await self.runs.update(seen.run_id, transitions.redispatch(seen.dispatch))
        if record is None:
            return False  # someone else moved it on since we looked
        await publish_task(self.js, record, self.lease_secret)
        reason = "running, but no lease and no task left in the queue"
        again = Redispatched(run_id=record.run_id, dispatch=record.dispatch, reason=reason)
        await emit(self.js, again, msg_id=f"redispatched.{record.run_id}.{record.dispatch}")
        log.warning("%s: %s; dispatched again (#%d)", record.run_id, reason, record.dispatch)
        return True

    async def _task_queued(self, record: RunRecord) -> bool:
        subject = names.task_subject(record.spec.pool, record.run_id)
        try:
            await self.js.get_last_msg(names.TASKS_STREAM, subject)
        except NotFoundError:
            return False
        return True

    async def _command(self, worker: str, cmd: Command) -> None:
        await self.nc.publish(names.control_subject(worker), encode(cmd))
