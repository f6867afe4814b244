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

And a watch can stop for good with no reconnect at all: on a clustered hub, the node that
served its consumer lost, nats-py resets the watch after two missed heartbeats, and if
that reset's request fails (JetStream electing a leader, answering nothing) its check
ends there, never to try again. The watch is then deaf, and whoever follows it acts on a
picture frozen in the past (seen in the fault campaign on the three-node hub: a scheduler
that counted trainers busy with runs long ended, and never admitted a queued run). So a
guard looks every `GUARD_S`: a bucket whose last sequence is past what was handed over,
twice in a row with nothing handed over between, is followed again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

__all__ = ["Following"]

GUARD_S = 10.0
"""How often the guard compares the bucket's last sequence with what was handed over."""


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
        self._guard: asyncio.Task[None] | None = None
        self.seen = 0
        """The highest sequence the watch delivered, deletions included."""
        self._checking = asyncio.Lock()
        """One `check` at a time: two reconnects in a row must not start two watches."""

    async def start(self) -> None:
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(watcher))
        if self._guard is None:
            self._guard = asyncio.create_task(self._guarding())

    async def _guarding(self) -> None:
        """Follow the bucket again when its watch fell silent behind it (the module's
        last paragraph); errors (the hub out of reach) wait for the next look."""
        behind_at = -1
        while True:
            await asyncio.sleep(GUARD_S)
            try:
                info = await self.js.stream_info(f"KV_{self.bucket}")
                last = info.state.last_seq or 0
                if last <= self.seen:
                    behind_at = -1
                elif behind_at == self.seen:  # behind, and nothing came since the last look
                    behind_at = -1
                    await self.check()
                else:
                    behind_at = self.seen
            except asyncio.CancelledError:
                raise
            except Exception:  # the hub out of reach: the next look tries again
                continue

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
                self.seen = 0
            await self.start()
            return went_back

    async def close(self) -> None:
        """Stop following, the guard too."""
        if self._guard is not None:
            self._guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._guard
            self._guard = None
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        try:
            async for entry in watcher:
                if entry is not None and entry.revision is not None:
                    self.seen = max(self.seen, entry.revision)
                if entry is None:  # the end of what was stored when the watch began
                    self.ready.set()
                elif entry.value and entry.revision is not None:
                    self.highest = max(self.highest, entry.revision)
                    self.on_entry(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
