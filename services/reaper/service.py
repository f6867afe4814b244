"""The reaper: periodic, idempotent sweeps that keep the run records true.

Every sweep reads the live runs' records (the truth), the leases and the worker registry, and
acts through compare-and-swap on the records, so two reapers may run at once: the second
one's CAS finds the change made, or finds nothing left to do. No time another host wrote
is compared with the reaper's clock (`clock.py`): durations it observes are on its monotonic
clock, a run's age and a record's on the hub server's. No correctness depends on them, only
when a run is given up.

    lost run     RUNNING, no lease, no task queued, for a whole lease TTL: dispatch again
                 (a stale worker's late ack can remove the task — docs/nats.md); if it was
                 asked to cancel (pause), cancel (pause) it instead
    unqueued     QUEUED and admitted, no task queued, for a whole lease TTL (whoever
                 admitted it died or failed before publishing its task): its task again,
                 at the same dispatch
    hard timeout past its deadline: FAILED (`hard_timeout`), its trainer stops the child
    soft timeout past its soft deadline: a `warning` event, once
    budget       spend past 25/50/75/100 % of `limits.max_cost`: a `warning` each, once
                 (`budgets.py`)
    orphan       a heartbeat names a run its worker does not hold: a kill command to it
    deliveries   a task or submission that used up its deliveries: dead letter, FAILED
    cancel       a run asked to cancel whose trainer is gone: CANCELLED (see lost run)
    lapse        (not a sweep: a watch) a lease expired while its run was RUNNING: the
                 run's task is delivered again now, not after its AckWait (`lapses.py`)
    silent       (a watch) a hub trainer holding a run sent no pulse for
                 `BATON_SILENT_AFTER`: its run handed over now (`silences.py`)
    departed     (a watch) a server closed the connection of a trainer holding a run, its
                 process gone: its run handed over at once (`departures.py`)
    revoked      (a watch) a machine revoked: the runs its trainers hold handed over now
                 (`revocations.py`)
    unannounced  a run that ended without its terminal event (the writer died in between):
                 the event published, once (`shared.state.endings`)
    garbage      checkpoint files never committed, older than `BATON_GC_AGE`: deleted
    retire       a run over for `BATON_GC_AGE`, its event stored: its last garbage
                 collected, its record archived, out of the live index (`shared.state.runs`)
    goodput      a run seen running that has ended: its goodput exported (`accounts.py`)
    credits      an ended run with a price: charged once, the rest of its holds given
                 back (`billing.py`); retired only once settled

    taken back   a run granted to a site silent past its `lost_after`: fenced in the
                 store, queued again at the hub (`grants.py`)

Beside the sweeps, the reaper watches the sites' greetings and (re)attaches their outboxes
to the hub's streams (`sites.py`), and takes in the records of the runs granted to sites
as they report them (`grants.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.reaper import budgets
from services.reaper.accounts import Accounts
from services.reaper.billing import Billing, billable
from services.reaper.clock import HubClock
from services.reaper.deliveries import on_advisory
from services.reaper.departures import Departures
from services.reaper.grants import Reconciler, TakeBack
from services.reaper.lapses import Lapses
from services.reaper.revocations import Revocations
from services.reaper.silences import Silences
from services.reaper.sites import SiteWatch
from shared.bus import names
from shared.bus.answer import handle
from shared.bus.emit import emit
from shared.bus.service import pull_loop
from shared.bus.streams import (
    declared,
    ensure,
    ensure_consumer,
    reaper_consumer,
    reconciler_consumer,
)
from shared.checkpoint import retention
from shared.checkpoint.store import open_store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, encode
from shared.contracts.control import Command, WorkerInfo
from shared.contracts.events import Redispatched, RunWarning
from shared.credentials import departures_credentials, lease_secret
from shared.state import transitions
from shared.state.endings import repair, settle
from shared.state.lease import holder as lease_holder
from shared.state.lease import lease_key
from shared.state.policy import Policy, load_table
from shared.state.runs import Runs, Stamped
from shared.state.tasks import publish_task
from shared.state.workers import live_workers

log = logging.getLogger("baton.reaper")


class Reaper:
    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self._unowned_since: dict[str, float] = {}
        self._unqueued_since: dict[str, float] = {}
        self._pending_since: dict[str, float] = {}
        self._recordless_since: dict[str, float] = {}
        self._orphan_seen: set[tuple[str, str]] = set()
        self._last_gc = float("-inf")
        self._seen = retention.Sightings()
        self.clock = HubClock(nc, self.js)
        self.store = open_store(settings.store_url)
        self.runs: Runs
        self.lapses: Lapses
        self.revocations: Revocations
        self.silences: Silences | None = None
        self.departures: Departures | None = None
        self.sites = SiteWatch(nc, self.js)
        self.lease_secret = lease_secret()
        self.accounts = Accounts(self.js)
        self.policy = Policy(self.js, load_table(settings.pools_file))
        """The pools' table in force (rates, disconnect policies), read again each sweep."""

    async def on_reconnect(self) -> None:
        # Pull consumers resume by themselves once NATS is back. The hub's sources may not:
        # if it was the hub's server that restarted, they retry on a back-off.
        self.sites.forget()
        if self.silences is not None:  # pulses sent while it was away went unheard
            self.silences.deafened(self.settings.silent_after_s)

    async def close(self) -> None:
        await self.store.close()

    async def start(self) -> None:
        async def declare() -> None:
            await ensure(self.js, self.settings.replicas)
            await ensure_consumer(self.js, names.ADVISORY_STREAM, reaper_consumer())
            await ensure_consumer(self.js, names.REPORTS_STREAM, reconciler_consumer())

        await declared(declare, log)
        self.runs = await Runs.open(self.js)
        self.reconciler = Reconciler(self.js, self.runs, self.store)
        self.billing = Billing(self.js, self.runs, self.sites)
        self.take_back = TakeBack(self.nc, self.js, self.runs, self.store, self.policy)
        self.lapses = Lapses(self.nc, self.js, self.runs, self.lease_secret)
        await self.lapses.start()
        self.revocations = Revocations(self.nc, self.js, self.runs, self.lease_secret)
        await self.revocations.start()
        self.silences = Silences(self.nc, self.js, self.runs, self.lease_secret, self.settings)
        await self.silences.start()
        self.departures = Departures(
            self.settings.nats_url, self.silences, departures_credentials()
        )
        await self.departures.start()
        await self.sites.start()

    async def serve(self, stop: asyncio.Event) -> None:
        advisories = pull_loop(
            self.js,
            names.ADVISORY_STREAM,
            names.REAPER_CONSUMER,
            stop,
            lambda msg: handle(
                self.js, msg, "reaper", lambda m: on_advisory(self.js, self.runs, m)
            ),
        )
        reports = pull_loop(
            self.js,
            names.REPORTS_STREAM,
            names.RECONCILER_CONSUMER,
            stop,
            lambda msg: handle(self.js, msg, "reaper", self.reconciler.on_report),
        )
        try:
            await asyncio.gather(advisories, reports, self._sweeping(stop), self.sites.watch(stop))
        finally:
            await self.sites.stop()
            await self.lapses.stop()
            await self.revocations.stop()
            if self.departures is not None:
                await self.departures.stop()
            if self.silences is not None:
                await self.silences.stop()

    async def _sweeping(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception:  # a link that is down, a server restarting: sweep again later
                log.exception("sweep failed; trying again in %.1fs", self.settings.sweep_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.sweep_s)

    async def sweep(self) -> list[str]:
        """One pass over every live run; returns the runs dispatched again. Reads the live
        index (`Runs.live_stamped`), never the history: its cost follows the live runs."""
        self.clock.tick()
        await self.policy.current(max_age_s=0)  # one read a sweep, whatever its pace
        live = await self.runs.live_stamped()
        records = [found.record for _, found in live if found is not None]
        running = [r for r in records if not r.state.terminal]
        workers = {w.worker: w for w in await live_workers(self.js)}
        redispatched = []
        # A run granted to a site is the site's to hand over; the hub takes it back once
        # the site is silent past its policy (`grants.py`). Its timeouts and budget are
        # the hub's, as any run's: an end the hub decides reaches the site with the grant
        # check (`transitions.forward_requests`), at once or when its link heals.
        await self.take_back.sweep([r for r in running if r.site], list(workers.values()))
        for r in running:
            if await self._timeouts(r):
                continue
            await self._budget(r)
            if r.site:
                continue
            if await self._queued_again(r):
                redispatched.append(r.run_id)
        await self._orphans(workers)
        await self._announce([r for r in records if r.state.terminal and r.announce_pending])
        await self._garbage(records)
        await self.accounts.sweep(records)
        await self.billing.sweep(records)
        await self._retire(live)
        alive = {r.run_id for r in running}
        for table in (self._unowned_since, self._unqueued_since):
            for run_id in [k for k in table if k not in alive]:
                del table[run_id]
        self.clock.forget(alive)
        log.debug("swept %d live run(s), %d running", len(live), len(running))
        return redispatched

    # -- sweeps --------------------------------------------------------------------------

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

    # -- helpers -------------------------------------------------------------------------

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
