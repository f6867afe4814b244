"""Following a KV bucket: each value as it is written, from the values it holds on.

nats-py's watch is an ordered push consumer: it resets itself after a gap or missed idle
heartbeats (a stream's leader lost in a clustered hub), so a follower keeps going through
an election, late by the reset, and never sees a write twice out of order.

It resets itself *after the last sequence it saw*, though: a hub that came back without the
unsynced tail of its streams (a host crash; docs/architecture.md, "The store decides")
writes its next values at sequences the watch has already passed, and the watch would wait,
silent, until the bucket's sequence caught up. `check` (after a reconnect) finds a bucket
whose last sequence is below the highest revision followed, tells the owner (`on_reset`:
what it kept of the lost writes is no longer the bucket's) and follows it again from the
values it holds.
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

    async def start(self) -> None:
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(watcher))

    async def check(self) -> bool:
        """Whether the bucket went back past what was followed (its stream's last sequence
        is below the highest revision handed over); if so, `on_reset` is called and the
        bucket followed again from the values it holds now."""
        info = await self.js.stream_info(f"KV_{self.bucket}")
        if info.state.last_seq >= self.highest:
            return False
        await self.stop()
        self.on_reset()
        self.highest = 0
        self.ready.clear()
        await self.start()
        return True

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
