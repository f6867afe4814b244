"""Following a KV bucket: each value as it is written, from the values it holds on.

nats-py's watch is an ordered push consumer: it resets itself after a gap or missed idle
heartbeats (a stream's leader lost in a clustered hub), so a follower keeps going through
an election, late by the reset, and never sees a write twice out of order.

The watch resumes after the last stream sequence it delivered, which is wrong once the
bucket went back: a hub server that lost the unsynced tail of its streams (a host crash: the
hub forgets, `shared.state.owner`) comes back with sequences lower than those seen, and a
watch resumed past them never delivers the writes that reuse them — and a follower keeping
each key's newest revision would take those writes for stale ones. A lost tail always comes
with a server restart, so once its client has reconnected a follower starts over:
`on_reset` drops what it kept, and the watch hands over the values the bucket holds now,
then every write after them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

__all__ = ["Following"]

RECONNECT_CHECK_S = 1.0
"""How often a follower looks whether its client reconnected since its watch began."""


class Following:
    """A KV bucket followed from the values it holds on: `on_entry` gets each value as it is
    written (deletions and expiries are skipped); `ready` is set once the values stored when
    the watch began have all been handed over. After the client reconnected, `on_reset`
    (if given) is called and the watch starts over: `ready` is cleared, the values the
    bucket holds now are handed over again, and it is set again."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        on_entry: Callable[[KeyValue.Entry], None],
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.on_entry = on_entry
        self.on_reset = on_reset
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reconnects = 0

    async def start(self) -> None:
        watcher = await self._watch()
        self._task = asyncio.create_task(self._run(watcher))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _reconnected(self) -> int:
        """How often the client reconnected so far."""
        nc = getattr(self.js, "_nc", None)
        return int(nc.stats.get("reconnects", 0)) if nc is not None else 0

    async def _watch(self) -> KeyValue.KeyWatcher:
        kv = await self.js.key_value(self.bucket)
        self._reconnects = self._reconnected()
        return await kv.watchall()

    async def _run(self, watcher: KeyValue.KeyWatcher) -> None:
        while await self._follow(watcher):  # the client reconnected: start over
            while True:
                try:
                    watcher = await self._watch()
                    break
                except Exception:  # the server still starting, a leader being elected
                    await asyncio.sleep(RECONNECT_CHECK_S)
            self.ready.clear()
            if self.on_reset is not None:
                self.on_reset()

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> bool:
        """Hand over the watch's values until it ends (False) or the client reconnected
        (True)."""
        delivering = asyncio.create_task(self._deliver(watcher))
        try:
            while not delivering.done():
                await asyncio.wait({delivering}, timeout=RECONNECT_CHECK_S)
                if self._reconnected() != self._reconnects:
                    return True
            delivering.result()
            return False
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await delivering
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def _deliver(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # the end of what was stored when the watch began
                self.ready.set()
            elif entry.value and entry.revision is not None:
                self.on_entry(entry)
