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
    sealed       a run cancelled at the hub: its checkpoint chain sealed in the store, so
                 a site that accepted the same job while cut off trains it in vain
                 (`seals.py`)
    garbage      checkpoint files never committed, older than `BATON_GC_AGE`: deleted
    retire       a run over for `BATON_GC_AGE`, its event stored: its last garbage
                 collected, its record archived, out of the live index (`shared.state.runs`)
    goodput      a run seen running that has ended: its goodput exported (`accounts.py`)
    credits      an ended run with a price: charged once, the rest of its holds given
                 back (`billing.py`); retired only once settled
    void         credits held for a run that has had no record for `BATON_VOID_AFTER`:
                 given back, nothing charged (`voids.py`)
    overdrawn    an owner's balance below the pool's `-overdraft`: their runs that hold
                 nothing (a site's submissions) asked to pause (`overdrafts.py`)
    cancelled    a run asked to cancel that nothing trains (QUEUED at the hub, PAUSED):
                 CANCELLED (`transitions.cancel_untrained`)

    taken back   a run granted to a site silent past its `lost_after`, or never taken by
                 its idle trainers there: fenced in the store, queued again at the hub; one
                 whose chain the hub's own attempt finished: completed from the store
                 (`grants.py`)

Beside the sweeps, the reaper watches the sites' greetings and (re)attaches their outboxes
to the hub's streams (`sites.py`), and takes in the records of the runs granted to sites
as they report them (`grants.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from services.reaper.accounts import Accounts
from services.reaper.billing import Billing
from services.reaper.clock import HubClock
from services.reaper.deliveries import on_advisory
from services.reaper.departures import Departures
from services.reaper.grants import Reconciler, TakeBack
from services.reaper.lapses import Lapses
from services.reaper.overdrafts import Overdrafts
from services.reaper.revocations import Revocations
from services.reaper.seals import Seals
from services.reaper.silences import Silences
from services.reaper.sites import SiteWatch
from services.reaper.sweeps import Sweeps
from services.reaper.voids import Voids
from shared.bus import names
from shared.bus.answer import handle
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
from shared.credentials import departures_credentials, lease_secret
from shared.state import transitions
from shared.state.endings import settle
from shared.state.policy import Policy, load_table
from shared.state.runs import Runs
from shared.state.workers import live_workers

log = logging.getLogger("baton.reaper")


class Reaper(Sweeps):
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
        self.reconciler = Reconciler(self.js, self.runs, self.store, self.policy)
        self.billing = Billing(self.nc, self.runs, self.sites)
        self.voids = Voids(self.nc, self.runs, self.billing.holds, self.settings.void_after_s)
        self.overdrafts = Overdrafts(self.nc, self.runs, self.billing.holds, self.policy)
        self.take_back = TakeBack(self.nc, self.js, self.runs, self.store, self.policy)
        self.seals = Seals(self.store)
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
            if transitions.cancel_untrained(r) is not None:
                # Asked to cancel, and nothing trains it (a cancel asked of a grant the hub
                # then took back, or of a run its site paused): ended here.
                await settle(self.js, self.runs, r.run_id, transitions.cancel_untrained)
                continue
            if await self._timeouts(r):
                continue
            await self._budget(r)
            if r.site:
                continue
            if await self._queued_again(r):
                redispatched.append(r.run_id)
        await self._orphans(workers)
        await self._announce([r for r in records if r.state.terminal and r.announce_pending])
        await self.seals.sweep(records)
        await self._garbage(records)
        await self.accounts.sweep(records)
        await self.billing.sweep(records)
        await self.voids.sweep()
        await self.overdrafts.sweep(running)
        await self._retire(live)
        alive = {r.run_id for r in running}
        for table in (self._unowned_since, self._unqueued_since):
            for run_id in [k for k in table if k not in alive]:
                del table[run_id]
        self.clock.forget(alive)
        log.debug("swept %d live run(s), %d running", len(live), len(running))
        return redispatched
