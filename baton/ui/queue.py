"""The Queue page: a pool's queue as the scheduler answers for it (`baton queue`), with the
owners' credit balances beside their shares.

Invariant (as `fleet`'s pages): a page following a pool's queue is sent it whenever it
changed, read every `fleet.REFRESH_S` by one request to the scheduler — nothing subscribes,
and no consumer is made, per read. The balances come from the credits ledger followed once
for the dashboard's life (`Credits`: one consumer, made when a Queue page is first read),
folded as entries are written, so a read costs the ledger nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client
from nats.errors import ConnectionClosedError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from baton.client import reader, scheduling
from baton.client.inspect import as_json
from baton.ui import fleet, params
from baton.ui.live import with_keepalive
from baton.ui.views import Reads
from shared.bus import names
from shared.contracts.pools import UNITS_PER_CREDIT
from shared.ledger.book import Account

log = logging.getLogger("baton.ui")

RETRY_S = 30.0
"""After the ledger could not be followed, how long until it is tried again."""
CAUGHT_UP_S = 5.0
"""How long a read waits for the ledger's entries stored before it was followed."""


class Credits:
    """Every owner's account, from the ledger's entries as they are written (one consumer
    of the whole ledger, `reader.read`, renewed if its node is lost)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.accounts: dict[str, Account] = {}
        self.caught_up = asyncio.Event()
        """Set once the entries stored when the ledger was first followed are folded."""
        self._sub: reader.StreamReader | None = None
        self._task: asyncio.Task[None] | None = None
        self._failed_at = float("-inf")

    async def follow(self) -> None:
        """Follow the ledger unless it is followed already (or failed less than `RETRY_S`
        ago: a ledger this dashboard may not read shows no balances, and is not asked every
        refresh), then wait — at most `CAUGHT_UP_S` — for what it held before."""
        if self._task is None and time.monotonic() - self._failed_at >= RETRY_S:
            try:
                self._sub = await reader.read(self.nc, names.LEDGER_STREAM, names.LEDGER_ALL)
            except Exception as exc:
                self._failed_at = time.monotonic()
                log.warning("the credits ledger cannot be followed (%r); no balances shown", exc)
                return
            if not self._sub.pending:
                self.caught_up.set()
            self._task = asyncio.create_task(self._fold(self._sub))
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.caught_up.wait(), CAUGHT_UP_S)

    async def _fold(self, sub: reader.StreamReader) -> None:
        while True:
            try:
                msg = await sub.next_msg(timeout=3600)
            except TimeoutError:
                continue
            except ConnectionClosedError:
                return
            scheduling.fold(self.accounts, msg)
            if msg.metadata.num_pending == 0:
                self.caught_up.set()

    def balances(self) -> dict[str, dict[str, float | bool]]:
        """Per owner with entries: its balance and what it holds, in credits, and whether
        it is overdrawn (below zero: `baton credits` says so too)."""
        return {
            owner: {
                "balance": a.balance / UNITS_PER_CREDIT,
                "held": a.held / UNITS_PER_CREDIT,
                "overdrawn": a.balance < 0,
            }
            for owner, a in sorted(self.accounts.items())
        }

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            await self._sub.unsubscribe()


class Queues:
    """What the Queue page shows of a pool: the scheduler's view, the pools to pick from
    (`known()`: those of the runs the dashboard knows) and the owners' balances."""

    def __init__(self, nc: Client, reads: Reads, known: Callable[[], set[str]]) -> None:
        self.nc = nc
        self.reads = reads
        self.known = known
        self.credits = Credits(nc)

    async def read(self, pool: str) -> dict[str, Any]:
        """`pool`'s queue as the page draws it; `scheduling.NotAnswering` when no
        scheduler answers for it."""
        self.reads.count += 1
        view = await scheduling.queue_view(self.nc, pool)
        await self.credits.follow()
        return {
            "pool": pool,
            "pools": sorted(self.known() | {"default", pool}),
            "view": as_json(view),
            "credits": self.credits.balances(),
        }

    def routes(self) -> list[Route]:
        return [Route("/api/queue", self.one), Route("/api/queue/live", self.live)]

    async def one(self, request: Request) -> Response:
        """A pool's queue (`pool`, default `default`) with the owners' balances; 503 saying
        so when no scheduler answers."""
        pool = params.pool(request.query_params.get("pool", "default"))
        try:
            return JSONResponse(await self.read(pool))
        except scheduling.NotAnswering as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)

    async def live(self, request: Request) -> Response:
        """The same, sent at once and again whenever it changed (`fleet.refreshing`); a
        read that fails — no scheduler answers — is sent as `failed`, with its reason."""
        pool = params.pool(request.query_params.get("pool", "default"))
        return StreamingResponse(
            with_keepalive(fleet.refreshing(lambda: self.read(pool))),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    async def stop(self) -> None:
        await self.credits.stop()
