"""Pushing to browsers: Server-Sent Events, and the trainers' heartbeats as they arrive.

SSE rather than WebSockets: the pushes go one way, the browser's `EventSource` reconnects by
itself and sends the id of the last message it got (`Last-Event-ID`), which is how a page
resumes where it was. No polling of NATS anywhere: what a page shows changes when a record,
an event or a heartbeat is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from baton.client.inspect import as_json
from shared.bus import names
from shared.bus.follow import Following
from shared.contracts import decode
from shared.contracts.control import WorkerInfo
from shared.errors import ContractError
from shared.state.clock import ServerClock, created

log = logging.getLogger("baton.ui")

KEEPALIVE_S = 15.0
"""A comment line this often keeps proxies and browsers from closing an idle stream."""


def sse(kind: str, data: Any, id: int | None = None) -> str:
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def with_keepalive(source: AsyncIterator[str]) -> AsyncIterator[str]:
    """`source`'s messages, with a keep-alive comment whenever it is quiet."""
    it = aiter(source)
    pending: asyncio.Task[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield ": keep-alive\n\n"
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


LIVE_QUEUE_MAX = 1000
"""Messages waiting for one browser, at most. A browser that falls this far behind (a slow
link, a stalled tab) is dropped rather than let its queue grow: the queue is emptied and its
stream ends. Its `EventSource` reconnects by itself, naming the last change it saw
(`Last-Event-ID`), and is sent the summaries changed since (`RunIndex.since`); a heartbeat
it missed is replaced by the trainer's next one."""


class Fanout:
    """Messages for every browser following the live stream, already in SSE form. Invariant:
    no browser's queue holds more than `limit` messages; one that would is dropped, and its
    queue then holds only the end of its stream (None)."""

    def __init__(self, limit: int = LIVE_QUEUE_MAX) -> None:
        self.limit = limit
        self.dropped = 0
        """Browsers dropped for falling behind, since start."""
        self._queues: set[asyncio.Queue[str | None]] = set()

    @property
    def following(self) -> int:
        return len(self._queues)

    def publish(self, kind: str, data: Any, id: int | None = None) -> None:
        message = sse(kind, data, id)
        for q in list(self._queues):
            try:
                q.put_nowait(message)
            except asyncio.QueueFull:
                self._drop(q)

    def _drop(self, q: asyncio.Queue[str | None]) -> None:
        self._queues.discard(q)
        self.dropped += 1
        while not q.empty():
            q.get_nowait()
        q.put_nowait(None)
        log.info("a browser fell %d messages behind the live stream: dropped", self.limit)

    @contextlib.asynccontextmanager
    async def follow(self) -> AsyncIterator[asyncio.Queue[str | None]]:
        """A queue of this browser's messages; None ends its stream (it was dropped)."""
        q: asyncio.Queue[str | None] = asyncio.Queue(maxsize=self.limit)
        self._queues.add(q)
        try:
            yield q
        finally:
            self._queues.discard(q)


def heard(info: WorkerInfo, stamped_at: float, now: float) -> dict[str, Any]:
    """A heartbeat as a browser is sent it. Invariant: its age is the hub's to say — the
    server's stamp of the heartbeat (`stamped_at`) and the hub's time when it was sent
    (`now`), both the hub server's clock; the page adds only the seconds since it got them
    on its own monotonic clock. The trainer's `at` is shown, never subtracted. `now` is at
    least `stamped_at`: the server stamped the entry before we heard of it, and a carried
    clock (`ServerClock`, off by up to a round trip) may lag that stamp by a little."""
    return {**as_json(info), "stamped_at": stamped_at, "now": max(now, stamped_at)}


class Heartbeats:
    """The trainers' heartbeats, as they are written, for every browser that follows them,
    each with the server's stamp of its entry and the hub's now (`heard`)."""

    def __init__(self, js: JetStreamContext, fanout: Fanout, clock: ServerClock) -> None:
        self.fanout = fanout
        self.clock = clock
        self.following = Following(js, names.WORKERS_BUCKET, self._beat)

    def _beat(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None
        with contextlib.suppress(ContractError, ValueError):
            info = decode(entry.value, WorkerInfo)
            self.fanout.publish("worker", heard(info, created(entry), self.clock.now()))
