"""The notifier: tells people, through their webhooks, when a run needs them.

Invariant: every event it tells of is told to each of its receivers once, or dead-lettered
for a receiver that refused it, before the event is acked: a receiver that is down keeps the
event in the durable consumer (`notifier` on `BATON_EVENTS`, new events only), nak'ed with
a back-off that doubles from `FIRST_RETRY_S` up to `MOST_RETRY_S`, for as long as the
stream keeps it. Training never waits on it: it is a service of its own, and no trainer
knows it exists.

    failed       a run FAILED (`failed` event)
    stalled      a `warning` of kind `stalled`
    budget_<n>   a `warning` of kind `budget_25|50|75|100` (the reaper's, `limits.max_cost`)
    guarded      a divergence guard stopped a run (`guarded` event)
    paused       a run paused for a human (`paused` event)
    site_cut_off a site silent longer than `[sites] cut_off_s`, and again when it is back
                 (`sites.py`)

Who is told is the alerts file's (`config.py`), by the run's pool; what they are sent, the
receiver's format (`formats.py`); that each is told once, the marks (`marks.py`).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.notifier import delivery
from services.notifier.alert import Alert, kind_of, of_event, payload_of, run_of_subject
from services.notifier.config import Alerts
from services.notifier.delivery import Delivery, Origin
from services.notifier.marks import Marks
from services.notifier.sites import SiteWatch
from shared.bus import names
from shared.bus.answer import handle
from shared.bus.service import pull_loop
from shared.bus.streams import declared, ensure, ensure_consumer, notifier_consumer
from shared.config import Settings
from shared.errors import TransientError
from shared.state.clock import stamp
from shared.state.runs import Runs

log = logging.getLogger("baton.notifier")

FIRST_RETRY_S = 2.0
MOST_RETRY_S = 300.0
CONCURRENCY = 8
"""Events handled at once: each waits on its receivers' answers (up to
`delivery.POST_TIMEOUT_S`), and one receiver that hangs must not hold up the others."""


def retry_delay(delivered: int) -> float:
    """The nak delay after the `delivered`-th delivery of an event failed at a receiver."""
    return min(MOST_RETRY_S, FIRST_RETRY_S * 2.0 ** min(20, max(0, delivered - 1)))


class Notifier:
    def __init__(self, nc: Client, settings: Settings, alerts: Alerts) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.alerts = alerts
        self.client: aiohttp.ClientSession | None = None
        self.delivery: Delivery
        self.runs: Runs
        self.sites: SiteWatch

    async def start(self) -> None:
        async def declare() -> None:
            await ensure(self.js, self.settings.replicas)
            await ensure_consumer(self.js, names.EVENTS_STREAM, notifier_consumer())

        await declared(declare, log)
        self.client = delivery.session()
        self.delivery = Delivery(self.js, self.client, await Marks.open(self.js))
        self.runs = await Runs.open(self.js)
        self.sites = SiteWatch(self.nc, self.js, self.alerts, self.delivery)
        log.info(
            "notifying %d receiver(s) from %s; sites cut off after %gs",
            self.alerts.count, self.alerts.path, self.alerts.cut_off_s,
        )  # fmt: skip

    async def serve(self, stop: asyncio.Event) -> None:
        events = pull_loop(
            self.js,
            names.EVENTS_STREAM,
            names.NOTIFIER_CONSUMER,
            stop,
            lambda msg: handle(self.js, msg, delivery.SOURCE, self.on_event),
            batch=CONCURRENCY,
            concurrency=CONCURRENCY,
        )
        if self.alerts.site_receivers():
            await asyncio.gather(events, self.sites.watch(stop))
        else:
            await events

    async def on_reconnect(self) -> None:
        pass  # the pull consumer resumes by itself; the site watch reads afresh each time

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def on_event(self, msg: Msg) -> None:
        """Tell the event's receivers (`answer.handle` maps the outcome: returned → ack; a
        receiver to try again → nak with the back-off; a malformed event → dead letter)."""
        alert = await self.alert_of(msg)
        if alert is None:
            return
        receivers = self.alerts.receivers(alert.pool, alert.kind)
        meta = msg.metadata
        origin = Origin(
            subject=msg.subject, payload=msg.data, headers=dict(msg.headers or {}),
            stream_seq=meta.sequence.stream, delivered=meta.num_delivered,
        )  # fmt: skip
        failed = await self.delivery.send(alert, receivers, origin)
        if failed:
            raise TransientError(
                f"{alert.key} ({alert.kind} {alert.run_id}): " + "; ".join(failed),
                delay=retry_delay(meta.num_delivered),
            )

    async def alert_of(self, msg: Msg) -> Alert | None:
        """The event's alert (its run's record found for the pool and name), or None."""
        payload = payload_of(msg.data)
        run_id, event_type = run_of_subject(msg.subject)
        if kind_of(event_type, payload) is None:
            return None
        record = await self.runs.find(run_id)
        meta = msg.metadata
        return of_event(msg.subject, payload, meta.sequence.stream, stamp(meta.timestamp), record)
