"""Sites cut off longer than their threshold: one alert when the silence passes it, one
"resolved" when the site greets again.

Invariant: how long a site has been silent is the hub server's clock now less its stamp
of the site's record in `baton_sites` — which the reaper rewrites on every greeting, about
once a second — two readings of one clock (docs/architecture.md, "Clocks"). Each cut-off
is an episode in the alerts bucket (`site.<site>`, `SiteEpisode`), moved firing → resolved
by compare-and-swap, so a restarted notifier, or two at once, tells each cut-off once: its
alerts' keys name the episode (`s.<site>.<episode>.<status>`) and go through the same
marks as events'.

A reaper that is down rewrites no record, so every site then looks silent from the hub: the
alert says what the hub knows ("no greeting recorded"), which is also true then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Literal

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.notifier.alert import of_site
from services.notifier.config import Alerts
from services.notifier.delivery import Delivery, Origin
from shared.backoff import Backoff
from shared.bus import names
from shared.contracts import decode, encode
from shared.contracts.alerts import SiteEpisode
from shared.state.clock import server_now, stamped_values

log = logging.getLogger("baton.notifier")

CHECK_MAX_S = 15.0


def check_every(cut_off_s: float) -> float:
    """A quarter of the threshold, between 1 s and `CHECK_MAX_S`: a cut-off is told at most
    that long after it passed its threshold."""
    return min(CHECK_MAX_S, max(1.0, cut_off_s / 4))


def judge(
    episode: SiteEpisode | None, site: str, heard: float, now: float, cut_off_s: float
) -> SiteEpisode | None:
    """The site's next episode given the server's stamp of its last greeting (`heard`) and
    its time `now`; None when nothing changed."""
    quiet = episode is None or episode.status == "resolved"
    if quiet and now - heard > cut_off_s:
        return SiteEpisode(
            site=site, episode=episode.episode + 1 if episode else 1, status="firing",
            last_heard=heard, noticed_at=now, cut_off_s=cut_off_s,
        )  # fmt: skip
    if episode is not None and episode.status == "firing" and heard > episode.last_heard:
        return msgspec.structs.replace(episode, status="resolved", back_at=heard)
    return None


class SiteWatch:
    def __init__(
        self, nc: Client, js: JetStreamContext, alerts: Alerts, delivery: Delivery
    ) -> None:
        self.nc = nc
        self.js = js
        self.alerts = alerts
        self.delivery = delivery
        self._kv: KeyValue | None = None
        self._episodes: dict[str, tuple[SiteEpisode, int]] = {}
        """Site → its newest episode and that key's revision in the alerts bucket."""
        self._done: set[str] = set()
        """Alert keys every receiver has answered for good."""
        self._retry: dict[str, tuple[float, Backoff]] = {}
        """Alert key → when to try its unanswered receivers again (monotonic), and how."""

    async def watch(self, stop: asyncio.Event) -> None:
        every = check_every(self.alerts.cut_off_s)
        while not stop.is_set():
            try:
                await self.check()
            except Exception as exc:  # the hub restarting, a leader election: next time
                log.warning("checking the sites failed (%s); again in %.0fs", exc, every)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)

    async def check(self) -> None:
        """Judge every site the hub has a record of, then send what is due."""
        if self._kv is None:
            self._kv = await self.js.key_value(names.ALERTS_BUCKET)
        now = await server_now(self.nc, f"KV_{names.SITES_BUCKET}")
        for stored in await stamped_values(self.js, names.SITES_BUCKET):
            await self._judge(self._kv, stored.key, stored.at, now)
        for episode, _ in list(self._episodes.values()):
            await self._send(episode, "firing")
            if episode.status == "resolved":
                await self._send(episode, "resolved")

    async def _judge(self, kv: KeyValue, site: str, heard: float, now: float) -> None:
        if site not in self._episodes:
            try:
                entry = await kv.get(f"site.{site}")
            except KeyNotFoundError:
                pass
            else:
                if entry.value and entry.revision is not None:
                    self._episodes[site] = (decode(entry.value, SiteEpisode), entry.revision)
        held = self._episodes.get(site)
        nxt = judge(held[0] if held else None, site, heard, now, self.alerts.cut_off_s)
        if nxt is None:
            return
        try:
            if held is None:
                revision = await kv.create(f"site.{site}", encode(nxt))
            else:
                revision = await kv.update(f"site.{site}", encode(nxt), last=held[1])
        except KeyWrongLastSequenceError:  # another notifier moved it first: read it again
            self._episodes.pop(site, None)
            return
        self._episodes[site] = (nxt, revision)
        log.warning(
            "site %s: %s", site,
            "cut off" if nxt.status == "firing" else "back; its cut-off is resolved",
        )  # fmt: skip

    async def _send(self, episode: SiteEpisode, status: Literal["firing", "resolved"]) -> None:
        alert = of_site(episode, status)
        if alert.key in self._done:
            return
        due = self._retry.get(alert.key)
        if due is not None and time.monotonic() < due[0]:
            return
        origin = Origin(
            subject=names.site_alert_subject(episode.site), payload=encode(episode), headers={},
            stream_seq=0, delivered=1,
        )  # fmt: skip
        failed = await self.delivery.send(alert, self.alerts.site_receivers(), origin)
        if not failed:
            self._done.add(alert.key)
            self._retry.pop(alert.key, None)
            return
        backoff = due[1] if due is not None else Backoff(first=2.0, most=300.0)
        delay = backoff.next()
        self._retry[alert.key] = (time.monotonic() + delay, backoff)
        log.info("%s: trying again in %.0fs: %s", alert.key, delay, "; ".join(failed))
