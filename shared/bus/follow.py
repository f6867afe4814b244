"""Following a KV bucket: each value as it is written, from the values it holds on.

nats-py's watch is an ordered push consumer: it resets itself after a gap or missed idle
heartbeats (a stream's leader lost in a clustered hub), so a follower keeps going through
an election, late by the reset, and never sees a write twice out of order.

After a server restart, though, it resets only once it has missed its idle heartbeats
(seconds, deaf meanwhile), and *after the last sequence it saw*: a hub that came back
without the unsynced tail of its streams (a host crash; docs/architecture.md, "The store
decides") writes its next values at sequences the watch has already passed, and the watch
would wait, silent, until the bucket's sequence caught up. So after a reconnect the owner
calls `check`: the bucket is followed again at once from the values it holds, and one
whose last sequence is below the highest revision followed is said to the owner first
(`on_reset`: what it kept of the lost writes is no longer the bucket's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

__all__ = ["Following"]


class Following:
    """A KV bucket followed from the values it holds on: `on_entry` gets each value as it is
    written (deletions and expiries are skipped); `ready` is set once the values stored when
    the watch began have all been handed over."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        on_entry: Callable[[KeyValue.Entry], None],
        on_reset: Callable[[], None] = lambda: None,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.on_entry = on_entry
        self.on_reset = on_reset
        self.ready = asyncio.Event()
        self.highest = 0
        """The highest revision handed over."""
        self._task: asyncio.Task[None] | None = None
        self._checking = asyncio.Lock()
        """One `check` at a time: two reconnects in a row must not start two watches."""

    async def start(self) -> None:
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(watcher))

    async def check(self) -> bool:
        """After a reconnect: follow the bucket again from the values it holds now; whether
        it went back past what was followed (its stream's last sequence below the highest
        revision handed over), in which case `on_reset` was called first."""
        async with self._checking:
            info = await self.js.stream_info(f"KV_{self.bucket}")
            went_back = info.state.last_seq < self.highest
            await self.stop()
            if went_back:
                self.on_reset()
                self.highest = 0
            await self.start()
            return went_back

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
                    self.highest = max(self.highest, entry.revision)
                    self.on_entry(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
