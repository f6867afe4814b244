"""Runs whose trainer's connection closed: handed over the moment the server says so.

A trainer process that dies — killed, crashed, out of memory — leaves its socket to the
kernel, which closes it, and the server that held the connection publishes a disconnect
advisory in its system account (`$SYS.ACCOUNT.<account>.DISCONNECT`) within milliseconds;
on a clustered hub every node's advisories reach every node. The reaper hears them on a
second connection, as the system account's `departures` user, which may hear nothing else
(`shared.auth.departures_permissions`). The departure of a trainer the reaper heard pulse
for a run (`silences.py`) is judged as its silence would be — the run's record must still
name that trainer and token — but now, not `BATON_SILENT_AFTER` later: a killed trainer's
run resumes elsewhere in a fraction of a second (docs/benchmarks.md, "Recovery").

Only closes that mean the process is gone count: "Client Closed" (the socket ended: the
process exited or died) and "Read Error" (it was reset). Not a server shutting down (its
clients reconnect to another node), nor a connection the server gave up on — slow, stale
— whose trainer may live and reconnect: its pulse decides. A trainer that closes its
connection on purpose has ended its attempt first (its lease released, its task
answered), so its record no longer names it. A trainer whose link was cut hard enough to
reset its socket loses its run now rather than at the silence's end; the lease and the
store's token fence it when it comes back.

The advisory names the connection and its user. The connection must be a trainer's
(`baton-trainer-<worker>`), its user the hub's trainer role or the joined machine that
worker belongs to (`m-<id>-trainer-<n>`), so no other user's connection speaks for a
trainer.

Without the user's credentials (`BATON_DEPARTURES_AUTH_FILE`, or `BATON_DEPARTURES_USER`
and `BATON_DEPARTURES_PASSWORD`; `baton up` and compose give them) the watch is off, and a
dead trainer's pulse decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.reaper.silences import Silences
from shared.auth import DISCONNECTS
from shared.bus.connect import connect
from shared.contracts import decode
from shared.contracts.control import Disconnected
from shared.credentials import Credentials, options_for
from shared.errors import ContractError

log = logging.getLogger("baton.reaper")

GONE = frozenset({"Client Closed", "Read Error"})
"""The reasons a server gives for a connection whose process is gone."""
TRAINER = "baton-trainer-"
"""A trainer's connection name, before its worker id (`shared.bus.service`)."""


def departed_worker(event: Disconnected) -> str | None:
    """The worker whose trainer process is gone, if `event` says one is."""
    if event.reason not in GONE or not event.client.name.startswith(TRAINER):
        return None
    worker = event.client.name.removeprefix(TRAINER)
    user = event.client.user
    return worker if user == "trainer" or worker.startswith(f"{user}-trainer-") else None


class Departures:
    def __init__(self, url: str, silences: Silences, creds: Credentials | None) -> None:
        self.url = url
        self.silences = silences
        self.creds = creds
        self.nc: Client | None = None
        self._start: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.creds is None or not self.silences.on:
            log.info("departures: not watched (no credentials, or no pulses); pulses decide")
            return
        # In the background: the reaper's own work never waits on this second connection.
        self._start = asyncio.create_task(self._listen(self.creds))

    async def _listen(self, creds: Credentials) -> None:
        self.nc = await connect(self.url, "baton-reaper-departures", options=options_for(creds))
        await self.nc.subscribe(DISCONNECTS, cb=self._on_advisory)
        await self.nc.flush()
        log.info("departures: hearing trainers' connections close")

    async def stop(self) -> None:
        if self._start is not None:
            self._start.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._start
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            event = decode(msg.data, Disconnected)
        except ContractError:
            return
        worker = departed_worker(event)
        if worker is not None:
            await self.silences.departed(worker, event.reason)
