"""Delegation: the hub grants queued runs to sites ahead of need (`shared.state.grants`).

A site whose link to the hub is cut must still have runs to start, so the hub hands each
site, while the link is up, a bounded share of its pools' queued work: per live trainer of
a pool at the site, the run it trains and `BATON_DELEGATE_AHEAD` more (default 1). A
grant is a compare-and-swap on the run's record (`transitions.delegate`: the next epoch,
the site named), then the task — carrying the granted record — published into the site's
own work queue, in the site's domain, acknowledged by the site's JetStream. The task's
message id names the run and epoch, so a grant sent again (its first send unanswered, or a
dispatcher restarted) is stored once within the duplicate window, and a later copy is
dropped at the site (`services/trainer/granted.py`).

Which sites have room is read off the worker registry (a site trainer's heartbeat reaches
the hub only while its site is linked) and the sites' greetings: a site that has not
greeted the hub for `SILENCE_S` is granted nothing more. Runs of several ranks are not
granted: a group of ranks forms at the hub, where its members find each other. A round
reads the live runs only while some site trainer is registered, so delegation costs a hub
without sites nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from nats.aio.client import Client

from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import publish
from shared.bus.emit import emit
from shared.config import Settings
from shared.contracts import RunRecord, RunState, Task, encode
from shared.contracts.events import Delegated
from shared.state import transitions
from shared.state.runs import Runs
from shared.state.workers import live_workers
from shared.waits import wait_set

log = logging.getLogger("baton.dispatcher")

ROUND_S = 1.0
"""How often the delegator looks for sites with room."""
SEND_TIMEOUT_S = 2.0


class Delegation:
    def __init__(self, nc: Client, runs: Runs, settings: Settings) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.runs = runs
        self.settings = settings
        self._sent: set[tuple[str, int]] = set()
        """(run, epoch) of the grants a site acknowledged, by this process."""
        self.now = asyncio.Event()
        """Set to look again at once: a run went to the hub's queue while some site was
        counted (its room may have grown since the last round, a trainer joining)."""
        self._sites = False
        """The last round counted some site with trainers."""
        self._free: dict[tuple[str, str], int] = {}
        """(site, pool) → runs the site may still be granted, as the last round counted;
        what a submission is granted from at once (`place`)."""
        self._spare: Counter[tuple[str, str]] = Counter()
        """(site, pool) → the part of its room that is ahead of need (`BATON_DELEGATE_AHEAD`
        per trainer): a replica of a replicated run is never granted into it (`_fits`)."""

    async def serve(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.round()
            except Exception as exc:  # the hub restarting, a link going: look again soon
                log.warning("delegating to sites failed (%s); again in %.0fs", exc, ROUND_S)
            await wait_set(self.now, ROUND_S)
            self.now.clear()

    async def room(self) -> Counter[tuple[str, str]]:
        """(site, pool) → runs the site may hold: per live trainer, one and its ahead. Only
        sites that greet the hub now: a trainer's heartbeat outlives a cut by its TTL."""
        room: Counter[tuple[str, str]] = Counter()
        self._spare = Counter()
        workers = [w for w in await live_workers(self.js) if w.site and not w.drained]
        if not workers:
            return room
        up = await sites.linked(self.nc)
        for w in workers:
            ahead = self.settings.ahead(w.site)
            if w.site in up and ahead > 0:  # 0: grants off for this site
                room[(w.site, w.pool)] += 1 + ahead
                self._spare[(w.site, w.pool)] += ahead
        return room

    async def round(self) -> int:
        """Grant what each site has room for; returns how many runs were granted."""
        room = await self.room()
        self._sites = bool(room)
        if not room:
            self._free = {}
            return 0
        linked = {site for site, _ in room}
        records = [found[0] for _, found in await self.runs.live() if found is not None]
        queued: dict[str, list[RunRecord]] = {}
        for r in records:
            if r.state.terminal:
                continue
            if r.site:
                room[(r.site, r.spec.pool)] -= 1
                unsent = r.state is RunState.QUEUED and (r.run_id, r.epoch) not in self._sent
                if unsent and r.site in linked:
                    await self._send(r)  # granted, but its site may not have it yet
            elif transitions.grantable(r):
                queued.setdefault(r.spec.pool, []).append(r)
        granted = 0
        for site, pool in sorted(room):
            granted += await self._grant_queued(site, pool, room, queued.get(pool, []))
        self._free = {k: v for k, v in room.items() if v > 0}
        return granted

    async def _grant_queued(
        self, site: str, pool: str, room: Counter[tuple[str, str]], queued: list[RunRecord]
    ) -> int:
        """Grant `site` the oldest of `queued` that fit its room (taking them off `queued`)."""
        granted = 0
        for r in sorted(queued, key=lambda r: r.created_at):
            if not self._fits(r, (site, pool), room[(site, pool)]):
                continue
            if await self._grant(r, site, queued_at_hub=True):
                granted += 1
                room[(site, pool)] -= 1
            queued.remove(r)
        return granted

    async def place(self, record: RunRecord) -> bool:
        """A new run, as it is dispatched: granted at once to a site with room, as the last
        round counted it. False: it goes to the hub's queue (a later round may still grant
        it)."""
        if not self._sites or not transitions.grantable(record):
            return False
        for (site, pool), free in self._free.items():
            if pool == record.spec.pool and self._fits(record, (site, pool), free):
                self._free[(site, pool)] = free - 1
                return await self._grant(record, site)
        self.now.set()  # no room as last counted: count again now, not in a second
        return False

    def _fits(self, record: RunRecord, at: tuple[str, str], free: int) -> bool:
        """Whether a site with `free` room left may be granted `record`. A replica only goes
        where a trainer is free for it now: held ahead at a site, it would wait while a
        trainer elsewhere could train it, and its rounds would wait for it."""
        return free > (self._spare[at] if record.spec.replicated else 0)

    async def _grant(self, seen: RunRecord, site: str, *, queued_at_hub: bool = False) -> bool:
        record = await self.runs.update(seen.run_id, transitions.delegate(site))
        if record is None:
            return False  # taken, cancelled or granted meanwhile
        log.info("%s: granted to site %s (epoch %d)", record.run_id, site, record.epoch)
        event = Delegated(run_id=record.run_id, site=site, epoch=record.epoch)
        await emit(self.js, event, msg_id=f"delegated.{record.run_id}.{record.epoch}")
        await self._send(record)
        if queued_at_hub:
            await self._forget_hub_task(record)
        return True

    async def _send(self, record: RunRecord) -> None:
        """Put the granted run's task into its site's work queue. Unanswered (the link went
        as it was granted), it is sent again next round; the record already says whose the
        run is, and if the site never gets it, its disconnect policy takes it back."""
        task = Task(run_id=record.run_id, spec=record.spec, dispatch=record.dispatch, grant=record)
        subject = names.site_task_subject(record.site, record.spec.pool, record.run_id)
        try:
            await publish(
                self.js, subject, encode(task), msg_id=f"grant.{record.run_id}.{record.epoch}",
                attempts=1, timeout=SEND_TIMEOUT_S,
            )  # fmt: skip
        except Exception as exc:
            log.info("%s: site %s did not take its grant yet (%s)", record.run_id, record.site, exc)
            return
        self._sent.add((record.run_id, record.epoch))

    async def _forget_hub_task(self, record: RunRecord) -> None:
        """The run's task in the hub's queue is no one's to take now: deleted, so that the
        queue shows only work the hub's trainers may start (one left behind is acked on
        sight by whoever fetches it)."""
        with contextlib.suppress(Exception):
            queued = await self.js.get_last_msg(
                names.TASKS_STREAM, names.task_subject(record.spec.pool, record.run_id)
            )
            if queued.seq is not None:
                await self.js.delete_msg(names.TASKS_STREAM, queued.seq)
