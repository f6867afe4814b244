"""Whether this trainer is drained, and the one event its work stops on.

Invariant: `leave` is set exactly while the trainer is stopping (SIGTERM: for good) or
drained (its key in `baton_drains`, `shared.state.drains`, or its machine's own notice that
it is going: `notices.py`, which no undrain lifts). Everything that runs work stops
on `leave` as it stops on SIGTERM — the pull loop fetches nothing more; an attempt asks its
training process to checkpoint and return, and hands the run over (PREEMPTED: the lease
released, the task nak'ed with no delay, so another trainer of the pool resumes it from
that checkpoint); a forming group's leader gives its task back; a rank held for another
trainer's group checkpoints with its group and leaves it — but a drained trainer's process
lives on: it heartbeats (`drained`), and takes work again once undrained.

The key is the order and the only truth: read at start (before the first fetch), before
every heartbeat and on every `wake` command. A read that fails (the hub unreachable) keeps
what was read last; reads are taken one at a time, so an older answer never overwrites a
newer one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js import JetStreamContext

from shared.contracts.control import Drain
from shared.logs import Condition
from shared.state.drains import Drains

log = logging.getLogger("baton.trainer")


class Draining:
    def __init__(self, js: JetStreamContext, worker: str, stop: asyncio.Event) -> None:
        self.worker = worker
        self.stop = stop
        self.leave = asyncio.Event()
        """Set while stopping or drained: what the attempt, a leader and a rank stop on."""
        self.record: Drain | None = None
        """The drain in force: the machine's own notice, else the operator's key."""
        self._key: Drain | None = None
        self._notice: Drain | None = None
        self._drains = Drains(js)
        self._reads = Condition(
            log, f"reading the drain key of {worker}", "the state read last holds"
        )
        self._undrained = asyncio.Event()
        self._undrained.set()
        self._reading = asyncio.Lock()

    @property
    def drained(self) -> bool:
        return self.record is not None

    def why(self) -> str:
        """Why `leave` is set: the drain's reason, or the trainer stopping."""
        if self.record is not None:
            return f"drained: {self.record.reason}" if self.record.reason else "drained"
        return "its trainer is stopping" if self.stop.is_set() else ""

    async def read(self) -> bool:
        """Read this worker's key now; whether being drained changed. Raises what the read
        raised (at start, where the trainer waits for the hub's buckets)."""
        async with self._reading:
            return self._set(await self._drains.get(self.worker))

    async def refresh(self) -> bool:
        """As `read`, but a read that fails keeps the state read last (and says no change)."""
        try:
            changed = await self.read()
        except Exception as exc:  # the hub unreachable: the next beat reads again
            self._reads.failed(exc)
            return False
        self._reads.ok()
        return changed

    async def follow_stop(self) -> None:
        """Set `leave` once the trainer is asked to stop (it never takes work again)."""
        await self.stop.wait()
        self.leave.set()

    async def until_undrained(self) -> None:
        """Until this trainer may take work again, or is stopping."""
        waits = [asyncio.create_task(e.wait()) for e in (self.stop, self._undrained)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await w

    def notice(self, drain: Drain) -> None:
        """Drained by this machine's own notice that it is going (a cloud reclaims or
        maintains it): until the trainer stops, whatever the key says."""
        self._notice = drain
        self._set(self._key)

    def _set(self, key: Drain | None) -> bool:
        was = self.drained
        self._key = key
        record = self._notice or key
        self.record = record
        if record is not None and not was:
            why = f": {record.reason}" if record.reason else ""
            log.warning("drained%s; taking no work, handing over what runs", why)
        elif record is None and was:
            log.warning("undrained; taking work again")
        if self.stop.is_set() or record is not None:
            self.leave.set()
        else:
            self.leave.clear()
        if record is None:
            self._undrained.set()
        else:
            self._undrained.clear()
        return was != self.drained
