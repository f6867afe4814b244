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
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from baton.cli.inspect import as_json
from shared.bus import names
from shared.contracts import decode
from shared.contracts.control import WorkerInfo
from shared.errors import ContractError

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


class Fanout:
    """Messages for every browser following the live stream, already in SSE form."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[str]] = set()

    def publish(self, kind: str, data: Any, id: int | None = None) -> None:
        message = sse(kind, data, id)
        for q in self._queues:
            q.put_nowait(message)

    @contextlib.asynccontextmanager
    async def follow(self) -> AsyncIterator[asyncio.Queue[str]]:
        q: asyncio.Queue[str] = asyncio.Queue()
        self._queues.add(q)
        try:
            yield q
        finally:
            self._queues.discard(q)


class Following:
    """A KV bucket followed from the values it holds on: `on_entry` gets each value as it is
    written (deletions and expiries are skipped); `ready` is set once the values stored when
    the watch began have all been handed over."""

    def __init__(
        self, js: JetStreamContext, bucket: str, on_entry: Callable[[KeyValue.Entry], None]
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.on_entry = on_entry
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(watcher))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is None:  # the end of what was stored when the watch began
                    self.ready.set()
                elif entry.value and entry.revision is not None:
                    self.on_entry(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]


class Heartbeats:
    """The trainers' heartbeats, as they are written, for every browser that follows them."""

    def __init__(self, js: JetStreamContext, fanout: Fanout) -> None:
        self.fanout = fanout
        self.following = Following(js, names.WORKERS_BUCKET, self._beat)

    def _beat(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None
        with contextlib.suppress(ContractError):
            self.fanout.publish("worker", as_json(decode(entry.value, WorkerInfo)))
