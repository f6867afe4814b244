"""The fleet's pages kept live: sites, streams and dead letters. Invariant: a page following
one of them is sent what it shows whenever that changed, read at most every `REFRESH_S` by
request-reply reads alone — nothing subscribes, and no consumer is made, per read — so the
cost of a following page is bounded whatever happens on the hub.

Sites come from the sites bucket followed once for the dashboard's life (`SiteRecords`, a
watch like the runs index's): listing a bucket's keys, as `baton sites` does, makes a
consumer each time and is not done per refresh. Each refresh adds to them what only the
server can say now — how far the hub has sourced each site (stream info requests) and the
hub's time. Streams are their stream and consumer infos; dead letters a page of message gets
(`views.letters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.kv import KeyValue

from baton.client.errors import CliError
from baton.client.inspect import as_json
from baton.ui.live import sse
from baton.ui.views import Reads
from shared.bus import names, sourcing
from shared.bus.follow import Following
from shared.contracts import decode
from shared.contracts.sites import SiteRecord
from shared.errors import BatonError, ContractError
from shared.state.clock import ServerClock, created

log = logging.getLogger("baton.ui")

REFRESH_S = 2.0
"""A following page's view is read again this often (and sent only when it changed)."""


class SiteRecords:
    """Every site the hub has heard of: its record and the hub server's stamp of it (when
    the reaper last wrote it, on a greeting), as the sites bucket is written."""

    def __init__(self, nc: Client, clock: ServerClock, reads: Reads) -> None:
        self.nc = nc
        self.clock = clock
        self.reads = reads
        self.records: dict[str, tuple[SiteRecord, float]] = {}
        self.following = Following(nc.jetstream(), names.SITES_BUCKET, self._entry)

    def _entry(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None
        with contextlib.suppress(ContractError, ValueError):  # a newer Baton's: left out
            record = decode(entry.value, SiteRecord)
            self.records[record.site] = (record, created(entry))

    async def views(self) -> list[Any]:
        """The sites as `baton sites` shows them (`sourcing.SiteView`), in name order."""
        if not self.records:
            return []
        lag: dict[str, int] = {}
        for stream in sourcing.SOURCED:
            self.reads.count += 1
            for api, state in (await sourcing.source_states(self.nc, stream)).items():
                lag[api] = lag.get(api, 0) + state.lag
        now = await self.clock.read()
        return [
            as_json(sourcing.view_of(r, at, now, lag.get(sourcing.api_of(r.site), 0)))
            for r, at in (self.records[k] for k in sorted(self.records))
        ]


def refreshing(read: Callable[[], Awaitable[dict[str, Any]]]) -> AsyncIterator[str]:
    """`read`'s answer as Server-Sent Events: a `view` at once, then again each time a read
    every `REFRESH_S` differs from the last one sent (its `now`, the hub's time, aside). A
    read that fails is sent as `failed` (with its reason, for the page to show) and tried
    again at the next refresh."""

    async def stream() -> AsyncIterator[str]:
        yield "retry: 1000\n\n"
        last: str | None = None
        while True:
            try:
                data = await read()
            except (NatsError, TimeoutError, BatonError, CliError) as exc:
                last = None
                yield sse("failed", {"error": f"{type(exc).__name__}: {exc}"})
            else:
                same = json.dumps({k: v for k, v in data.items() if k != "now"}, sort_keys=True)
                if same != last:
                    last = same
                    yield sse("view", data)
            await asyncio.sleep(REFRESH_S)

    return stream()
