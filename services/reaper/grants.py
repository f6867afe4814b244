"""The hub's side of runs granted to sites (`shared.state.grants`): taking in what the
sites report, and taking back what a silent site holds.

**Reports.** Each site's runs bucket — the records of the runs granted to it, written by
its trainers — is sourced into the hub's `BATON_REPORTS` work queue
(`shared.bus.sourcing`), once, in the site's order, resuming after any cut. The reconciler
takes each in by one compare-and-swap (`transitions.reconcile`): while the hub's record
still grants the run to that site under the reported epoch, it becomes the site's record.
A run submitted at the site (`services/dispatcher/site.py`) that the hub has no record of
is created from the site's record (`Runs.create`: one record per id, ever, archive
included). So a run that finished at a cut-off site is COMPLETED at the hub once, by its
site's own record, when the link heals — no lease is taken, no attempt started and no commit made at
the hub for it. A report of a grant the hub has since taken back changes nothing.

**Two sides.** A report of a run the hub holds otherwise — it ran the same job too, or
granted it to another site — is taken in only when the store's chain is the reporting
site's under the reported epoch (`shared.state.owner`): the record follows the store, and a
`superseded` event names both sides and what the other trained in vain. The other side's
attempt is stopped by its next look at the store.

**Taking back.** The reaper's sweep looks at every live run granted to a site; once the
site has been silent (no greeting, on the hub server's clock) for the run's `lost_after` —
or, for a run nobody there trains now, linked but without an undrained trainer of its pool
(all drained, or gone) for as long, or beside trainers of its pool idle all the while that
never take it for `UNTAKEN_AFTER_S` (its task lost: a grant check that read a stale copy of
the hub's record, a grant sent as the link healed that never arrived), or whose site's
record names a trainer whose heartbeats have not named the run for as long (a record
nobody there acts on: the trainer gone, idle, or training another run) —
(`shared.contracts.jobs.Disconnect`), and its policy allows replacing it, the run is taken
back: first the store's `latest` is moved to the next epoch (`grants.fence`), so the site's
commits are refused from that instant, then the record (`transitions.take_back`) and a
fresh task for the hub's queue, and a `taken_back` event. A run whose final checkpoint is
already committed is not taken back: it was trained to the end, and its site's record will
say so at heal. A run asked to cancel that its site has not started is taken back at once,
whatever its link, and the sweep then cancels it: its site may never have got the grant
(one sent as a link healed, seen in the fault campaign), and a site that did and starts it
after all is refused by the fence.

**Finished by the hub.** A run granted to a site whose chain the hub's own attempt ended
with a final commit (the same job at both sides of a cut, the site's submission taken in
while the hub trained it) is one its site never completes: the site's attempt yields to
another side's final chain. The sweep looks at the store for each granted run nobody
holds (once per `FINAL_LOOK_S` per record revision) and completes such a run from the
store's final checkpoint (`transitions.complete_from_store`), announced once; a run whose
chain the hub sealed (cancelled, then forgotten with the hub's unsynced tail) is
CANCELLED the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.emit import emit
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.contracts import RunRecord, RunState, decode
from shared.contracts.control import WorkerInfo
from shared.contracts.events import Superseded, TakenBack
from shared.errors import ContractError
from shared.state import grants, owner, transitions
from shared.state.endings import settle
from shared.state.policy import Policy, disconnect_of
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")

UNTAKEN = "with idle trainers that never take it"
UNHELD = "with its record held by"

UNTAKEN_AFTER_S = 120.0
"""How long a linked site's trainers of a run's pool may all sit idle beside it, granted and
queued there, before its task is taken for lost (at most the run's `lost_after`): an idle
trainer takes a queued task within a second."""

FINAL_LOOK_S = 10.0
"""How often the sweep reads the store's `latest` of a granted run nobody holds whose
record has not changed meanwhile."""


class Reconciler:
    def __init__(self, js: JetStreamContext, runs: Runs, store: Store, policy: Policy) -> None:
        self.js = js
        self.runs = runs
        self.store = store
        self.policy = policy

    async def on_report(self, msg: Msg) -> None:
        """One revision of a site's record of a run granted to it."""
        site = msg.subject.split(".")[2]
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            return  # a site's record expiring: nothing to take in
        reported = decode(msg.data, RunRecord)
        if reported.site != site or msg.subject != names.report_subject(site, reported.run_id):
            raise ContractError(
                f"site {site} reported a record of {reported.run_id!r} granted to "
                f"{reported.site or 'the hub'!r}"
            )
        held = await self.runs.find(reported.run_id)
        owns = False
        if held is not None and (held.site, held.epoch) != (site, reported.epoch):
            # The hub ran it too, or granted it elsewhere: the store's chain decides.
            latest = await commit.read_latest(self.store, reported.run_id)
            owns = owner.wins_report(site, reported.epoch, latest[0] if latest else None)
        change = transitions.reconcile(site, reported, owns)
        new = await self.runs.update(reported.run_id, change)
        if owns and new is not None and held is not None:
            await self._superseded(held, new)
        if new is None and await self.runs.find(reported.run_id) is None:
            # Submitted at the site, unknown here (nor archived): the hub's record is the
            # site's, once — for a run id the site's own users may make (an operator's, or
            # a `<site>-` submitter's).
            submitter = reported.run_id.rpartition(".")[0]
            if submitter and not submitter.startswith(f"{site}-"):
                raise ContractError(
                    f"site {site} reported a run of {submitter!r}, which it cannot own"
                )
            if await self.runs.create(await self._priced(reported)):
                log.info("%s: submitted at site %s; taken in", reported.run_id, site)
                return
            new = await self.runs.update(reported.run_id, change)  # created meanwhile
        if new is not None and new.state.terminal:
            log.info("%s: %s at site %s; taken in", new.run_id, new.state.value, site)

    async def _priced(self, reported: RunRecord) -> RunRecord:
        """A run submitted at a site, as the hub takes it in: at its pool's price then, if
        the pool has one and the run an owner — charged when it ends like any run, though
        nothing was held for it (the site could not read the ledger while cut off)."""
        pool = (await self.policy.current()).pool(reported.spec.pool)
        if reported.price or not reported.owner or not pool.priced():
            return reported
        return msgspec.structs.replace(reported, price=dict(pool.price))

    async def _superseded(self, held: RunRecord, new: RunRecord) -> None:
        """Say, once, that the hub's copy of the run gave way to a site's (`owner`): the
        side it was held by and what that side trained in vain."""
        loser = f"site {held.site}" if held.site else "the hub"
        log.warning("%s: trained at %s and at site %s; the store chose site %s (epoch %d)",
                    new.run_id, loser, new.site, new.site, new.epoch)  # fmt: skip
        event = Superseded(
            run_id=new.run_id, owner=new.site, epoch=new.epoch, loser=held.site,
            loser_token=held.token or 0, wasted_steps=held.step,
        )  # fmt: skip
        await emit(self.js, event, msg_id=f"superseded.{new.run_id}.{new.epoch}")


@dataclass(frozen=True)
class SiteTrainers:
    """What the sites' trainers' heartbeats say, as a sweep reads them."""

    serving: set[tuple[str, str]]
    """(site, pool) with an undrained trainer."""
    idle: set[tuple[str, str]]
    """(site, pool) with an undrained trainer that trains nothing."""
    training: dict[str, str | None]
    """Each site trainer → the run it trains (None: nothing)."""

    @classmethod
    def of(cls, workers: list[WorkerInfo]) -> SiteTrainers:
        at_sites = [w for w in workers if w.site]
        return cls(
            serving={(w.site, w.pool) for w in at_sites if not w.drained},
            idle={(w.site, w.pool) for w in at_sites if not w.drained and not w.run_id},
            training={w.worker: w.run_id for w in at_sites},
        )


class TakeBack:
    def __init__(
        self, nc: Client, js: JetStreamContext, runs: Runs, store: Store, policy: Policy
    ) -> None:
        self.nc = nc
        self.js = js
        self.runs = runs
        self.store = store
        self.policy = policy
        self._unserved_since: dict[tuple[str, str], float] = {}
        """(site, pool) → when a linked site was first seen without an undrained trainer of
        the pool (this reaper's monotonic clock)."""
        self._final: set[tuple[str, int]] = set()
        """(run, epoch) found trained to the end at a silent site: said once."""
        self._idle_since: dict[tuple[str, int], float] = {}
        """(run, epoch) → when a granted run nobody holds was first seen beside idle
        trainers of its pool at its linked site (this reaper's monotonic clock)."""
        self._stale_since: dict[tuple[str, int], float] = {}
        """(run, epoch) → when a granted run its site's record says a trainer holds was
        first seen while that trainer's heartbeats name no such run (same clock)."""
        self._looked: dict[tuple[str, float], float] = {}
        """(run, record revision's `updated_at`) → when its store was last read."""

    async def sweep(self, granted: list[RunRecord], workers: list[WorkerInfo]) -> list[str]:
        """Complete every run in `granted` that the hub's own attempt finished in the store,
        take back at once every one asked to cancel that its site has not started, and
        take back every other one whose site has been silent — or has had no undrained
        trainer of the run's pool (every one drained or gone), or idle ones that never take
        it, or a record naming a trainer that does not train it — past its policy's
        `lost_after`; returns the runs completed or taken back."""
        trainers = SiteTrainers.of(workers)
        now = time.monotonic()
        unheld = [r for r in granted if r.worker is None]
        kept = {(r.run_id, r.epoch) for r in unheld}
        self._idle_since = {k: t for k, t in self._idle_since.items() if k in kept}
        held = {(r.run_id, r.epoch) for r in granted if r.worker is not None}
        self._stale_since = {k: t for k, t in self._stale_since.items() if k in held}
        for key in [k for k in self._unserved_since if k in trainers.serving]:
            del self._unserved_since[key]
        if not granted:
            return []
        silent = {v.site: v.last_seen_s for v in await sites.views(self.nc)}
        taken = []
        self._looked = {k: t for k, t in self._looked.items() if now - t < FINAL_LOOK_S}
        for r in unheld:
            if (r.run_id, r.updated_at) not in self._looked:
                self._looked[(r.run_id, r.updated_at)] = now
                if await self.finished_by_hub(r):
                    taken.append(r.run_id)
        for r in (r for r in granted if r.run_id not in taken):
            why = self._due(r, now, silent, trainers)
            if why is not None and await self.take_back(r, why):
                taken.append(r.run_id)
        return taken

    def _due(
        self,
        r: RunRecord,
        now: float,
        silent: dict[str, float],
        trainers: SiteTrainers,
    ) -> str | None:
        """Why the granted run `r` is to be taken back now; None while it is not."""
        if r.cancel_requested is not None and r.state is RunState.QUEUED and not r.worker:
            # Asked to cancel before its site took it: the hub's to end, now (the sweep then
            # cancels it, `cancel_untrained`), not once a site that may never have got its
            # grant (sent as a link healed) takes it. Fenced first: should the site start it
            # after all, its commits are refused.
            return f"asked to cancel before site {r.site} started it"
        policy = disconnect_of(r.spec, self.policy.table)
        bound = policy.lost_after_s
        quiet, why = silent.get(r.site), "silent"
        if quiet is not None and quiet < sites.SILENCE_S:
            quiet, why = self._unserved(r, now, trainers)
            if why == UNTAKEN or why.startswith(UNHELD):
                bound = min(bound, UNTAKEN_AFTER_S)
        else:
            # Cut off: its trainers' heartbeats come back through the outbox some time after
            # the link does, so a record's trainer is judged afresh from the heal.
            self._stale_since.pop((r.run_id, r.epoch), None)
        if quiet is None or quiet < bound or not policy.replace:
            return None
        return f"site {r.site} {why} for {quiet:.0f}s (lost_after {policy.lost_after_s:.0f}s)"

    def _unserved(
        self, r: RunRecord, now: float, trainers: SiteTrainers
    ) -> tuple[float | None, str]:
        """For a run granted to a linked site: how long nobody there has been able to take
        it, or the trainer its record names has not trained it, and why; (None, "") while
        it is trained, paused, or waits its turn."""
        if r.state is RunState.PAUSED:
            return None, ""  # waiting for a resume
        if r.worker is not None:
            # Its site's record says who trains it; that trainer's heartbeats say whether it
            # does. A record no trainer there acts on (its task ended at the site, or spent
            # its deliveries, while the record stayed RUNNING) would be waited on for ever.
            doing = trainers.training.get(r.worker, "")  # "": no heartbeat of it
            if doing == r.run_id:
                self._stale_since.pop((r.run_id, r.epoch), None)
                return None, ""
            since = self._stale_since.setdefault((r.run_id, r.epoch), now)
            said = "is gone" if doing == "" else f"trains {doing or 'nothing'}"
            return now - since, f"{UNHELD} {r.worker}, which {said},"
        where = (r.site, r.spec.pool)
        if where not in trainers.serving:  # every trainer of its pool there drained, or gone
            since = self._unserved_since.setdefault(where, now)
            return now - since, f"without a trainer of pool {r.spec.pool}"
        if where not in trainers.idle:
            # Its trainers there are busy: one takes it in turn. Idle is counted afresh
            # from the next time they all are (a trainer between two runs is idle a moment).
            self._idle_since.pop((r.run_id, r.epoch), None)
            return None, ""
        # Idle trainers there, and nobody takes it: its task is gone.
        since = self._idle_since.setdefault((r.run_id, r.epoch), now)
        return now - since, UNTAKEN

    async def finished_by_hub(self, r: RunRecord) -> bool:
        """Complete `r` from the store when its chain ends in the hub's own final commit
        (the module's "finished by the hub"), or end it CANCELLED when the hub sealed it
        (`commit.seal`); True if it did."""
        found = await commit.read_latest(self.store, r.run_id)
        if found is not None and found[0].ended and not found[0].site:
            # Cancelled at the hub, which then forgot (its unsynced tail lost) and took the
            # site's copy in; the site let it go on the sealed chain: the record follows.
            why = f"{found[0].ended} at the hub: its checkpoint chain is sealed"
            if await settle(self.js, self.runs, r.run_id, transitions.end_granted(
                r.site, r.epoch, RunState.CANCELLED, why
            )) is None:  # fmt: skip
                return False
            log.warning("%s: granted to site %s, but %s", r.run_id, r.site, why)
            return True
        if found is None or not found[0].final or found[0].site:
            return False
        manifest = await commit.load_manifest(self.store, found[0].manifest)
        done = transitions.complete_from_store(
            r.site, r.epoch, manifest.step, manifest.digest, manifest.metrics
        )
        if await settle(self.js, self.runs, r.run_id, done) is None:
            return False
        log.warning("%s: granted to site %s, but the hub's attempt committed its final "
                    "checkpoint (step %d): completed from the store", r.run_id, r.site,
                    manifest.step)  # fmt: skip
        return True

    async def take_back(self, r: RunRecord, why: str) -> bool:
        epoch = r.epoch + 1
        if not await grants.fence(self.store, r.run_id, epoch):
            if (r.run_id, r.epoch) not in self._final:
                self._final.add((r.run_id, r.epoch))
                log.info("%s: %s, but its final checkpoint is committed; its record is "
                         "awaited", r.run_id, why)  # fmt: skip
            return False
        record = await self.runs.update(r.run_id, transitions.take_back(r.site, r.epoch))
        if record is None:
            return False  # it ended, or moved on, meanwhile
        # QUEUED for the hub's scheduler, which admits it in its turn (`shared.scheduling`).
        event = TakenBack(run_id=r.run_id, site=r.site, epoch=record.epoch, reason=why)
        await emit(self.js, event, msg_id=f"taken_back.{r.run_id}.{record.epoch}")
        log.warning("%s: taken back: %s; queued again under epoch %d", r.run_id, why, epoch)
        return True
