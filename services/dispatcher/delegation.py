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

Which run goes to which site is the scheduler's decision (`scheduler.py`): it takes runs
in its queue's order, and a site's room is read off the trainers' heartbeats (a site
trainer's heartbeat reaches the hub only while its site is linked) and the sites'
greetings: a site that has not greeted the hub for `SILENCE_S` is granted nothing more.
A group of several ranks is granted only to a site with as many trainers free now, and
forms there (its key in the site's groups bucket, its calls in the site's work queue:
`services/trainer/group.py`); an elastic run is granted where its `min` is free, and forms
and grows there up to its `max` with the site's trainers. Sites' links are read only
while some site trainer is live, so delegation costs a hub without sites nothing.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client

from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import publish
from shared.bus.emit import emit
from shared.config import Settings
from shared.contracts import RunRecord, Task, encode
from shared.contracts.events import Delegated
from shared.state import transitions
from shared.state.runs import Runs

log = logging.getLogger("baton.dispatcher")

SEND_TIMEOUT_S = 2.0


class Delegation:
    """Grants runs to sites as the scheduler decides (`scheduler.py`: which run, which
    site, in the queue's order), and sends again a grant a site has not acknowledged."""

    def __init__(self, nc: Client, runs: Runs, settings: Settings) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.runs = runs
        self.settings = settings
        self._sent: set[tuple[str, int]] = set()
        """(run, epoch) of the grants a site acknowledged, by this process."""

    async def linked_sites(self, needed: bool) -> set[str]:
        """The sites that greet the hub now (a trainer's heartbeat outlives a cut by its
        TTL); none asked when no trainer at a site is live (`needed`)."""
        return await sites.linked(self.nc) if needed else set()

    async def grant(self, seen: RunRecord, site: str) -> RunRecord | None:
        """Grant `seen`'s run to `site`: one CAS on its record, then its task into the
        site's work queue. None when the run moved on meanwhile."""
        record = await self.runs.update(seen.run_id, transitions.delegate(site))
        if record is None:
            return None  # taken, cancelled or granted meanwhile
        log.info("%s: granted to site %s (epoch %d)", record.run_id, site, record.epoch)
        event = Delegated(run_id=record.run_id, site=site, epoch=record.epoch)
        await emit(self.js, event, msg_id=f"delegated.{record.run_id}.{record.epoch}")
        await self._send(record)
        return record

    async def resend(self, granted: list[RunRecord]) -> None:
        """Send again the grants of runs still queued at a linked site that it has not
        acknowledged to this process (its first send went unanswered, or this dispatcher
        restarted): the message id makes a repeat one message."""
        for r in granted:
            if (r.run_id, r.epoch) not in self._sent:
                await self._send(r)

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
