"""The reaper's watch over sites: attach each site's outbox to the hub's streams, and
re-attach it the moment a link comes back (see `shared.bus.sourcing` for why).

Greetings arrive on core NATS; this keeps, per site, when the last one came. The first
greeting from a site this reaper has not heard of, or after a silence longer than
`SILENCE_S`, links the site with a nudge; every greeting updates the site's record in the
`baton_sites` bucket, which is what `baton sites` reads. Two reapers may both nudge: a
re-attached source resumes where the hub stopped, so that costs nothing but a stream
update.

A greeting after a silence is not the only way a source stalls: after the hub's own server
restarts, its sources start before the leaf has relinked, fail, and back off (seen in the
hub-restart chaos test: the heartbeats' source stayed idle long after the link was up), and
on a clustered hub, losing the node that led a sourced stream or held the site's link does
the same to the new leader's source (seen in the cluster tests: the heartbeats' source idle
for 10–40 s when the check rode on the 15 s sweep). So every `CHECK_S`, while any site
greets, the watch asks the hub's streams whether that site's sources are active, and
nudges a site whose source is not — at most once per `RENUDGE_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared.bus import names
from shared.bus import sourcing as sites
from shared.contracts import decode, encode
from shared.contracts.sites import SiteHello, SiteRecord
from shared.errors import ContractError

log = logging.getLogger("baton.reaper")

RENUDGE_S = 5.0
CHECK_S = 2.0
"""How often the sources of greeting sites are checked: a STREAM.INFO per sourced stream,
and none while no site greets."""


class SiteWatch:
    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._heard: dict[str, float] = {}
        """Site → monotonic time of its last greeting."""
        self._linking: dict[str, asyncio.Task[None]] = {}
        self._nudged: dict[str, float] = {}
        """Site → monotonic time of its last nudge."""
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(names.HELLO_ALL, cb=self._on_hello)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for task in self._linking.values():
            task.cancel()
        await asyncio.gather(*self._linking.values(), return_exceptions=True)

    def forget(self) -> None:
        """Take every site's next greeting as a return (our own link was down)."""
        self._heard.clear()

    async def watch(self, stop: asyncio.Event) -> None:
        """`check` every CHECK_S until `stop`."""
        while not stop.is_set():
            try:
                await self.check()
            except Exception as exc:  # the hub electing or restarting: check again soon
                log.warning("checking the sites' sources failed (%s); again in %.0fs", exc, CHECK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CHECK_S)

    async def check(self) -> None:
        """Nudge every greeting site one of whose sources at the hub is idle or failing."""
        now = time.monotonic()
        live = {s for s, t in self._heard.items() if now - t < sites.SILENCE_S}
        if not live:
            return
        stalled: set[str] = set()
        for stream in sites.SOURCED:
            for api, state in (await sites.source_states(self.nc, stream)).items():
                site = sites.site_of(api)
                if site in live and not state.active:
                    stalled.add(site)
        for site in sorted(stalled):
            busy = self._linking.get(site)
            if (busy is None or busy.done()) and now - self._nudged.get(site, -RENUDGE_S) >= (
                RENUDGE_S
            ):
                log.info("site %s: a source at the hub is idle; nudging it", site)
                hello = SiteHello(site=site, at=time.time())
                # Not a return of the link: the site's record is left as its greetings say.
                self._linking[site] = asyncio.create_task(
                    self._link(hello, first=False, returned=False)
                )

    async def caught_up(self, site: str) -> bool:
        """The site greets the hub now, and the hub's events stream has sourced everything
        the site's outbox holds: nothing the site published is still on its way."""
        if time.monotonic() - self._heard.get(site, float("-inf")) >= sites.SILENCE_S:
            return False
        states = await sites.source_states(self.nc, names.EVENTS_STREAM)
        state = states.get(sites.api_of(site))
        return state is not None and state.active and state.lag == 0

    async def _on_hello(self, msg: Msg) -> None:
        try:
            hello = decode(msg.data, SiteHello)
        except ContractError as exc:
            log.warning("ignored a malformed greeting on %s: %s", msg.subject, exc)
            return
        if msg.subject != names.hello_subject(hello.site):
            log.warning("ignored a greeting from %s on %s", hello.site, msg.subject)
            return
        now = time.monotonic()
        last = self._heard.get(hello.site)
        self._heard[hello.site] = now
        relink = last is None or now - last > sites.SILENCE_S
        busy = self._linking.get(hello.site)
        if relink and (busy is None or busy.done()):
            self._linking[hello.site] = asyncio.create_task(self._link(hello, first=last is None))
        elif busy is None or busy.done():
            with contextlib.suppress(Exception):  # the record is informational; next time
                await self._record(hello, linked=False)

    async def _link(self, hello: SiteHello, *, first: bool, returned: bool = True) -> None:
        self._nudged[hello.site] = time.monotonic()
        try:
            await sites.link(self.js, hello.site, nudge=True)
        except Exception as exc:
            # Forget the greeting, so that the next one tries again.
            self._heard.pop(hello.site, None)
            log.warning("linking site %s failed (%s); will retry", hello.site, exc)
            return
        if not returned:
            return
        log.info("site %s %s; its outbox is attached", hello.site, "joined" if first else "is back")
        with contextlib.suppress(Exception):
            await self._record(hello, linked=True)

    async def _record(self, hello: SiteHello, *, linked: bool) -> None:
        kv = await self.js.key_value(names.SITES_BUCKET)
        now = time.time()
        try:
            entry = await kv.get(hello.site)
            old = decode(entry.value or b"", SiteRecord)
        except KeyNotFoundError:
            old = SiteRecord(
                site=hello.site, first_seen=now, last_hello=now, linked_at=now, links=0
            )
        record = msgspec.structs.replace(
            old,
            last_hello=now,
            outbox_last_seq=hello.outbox_last_seq,
            linked_at=now if linked else old.linked_at,
            links=old.links + 1 if linked else old.links,
        )
        await kv.put(hello.site, encode(record))
