"""Runs whose trainer fell silent: handed over seconds after its pulse stops, not a TTL later.

A hub trainer holding a run sends a pulse every `BATON_PULSE` seconds (`services/trainer/
pulse.py`). The reaper hears every pulse (one core-NATS subscription, nothing stored) and
keeps, per trainer, when it last heard it and which attempt it named. A trainer unheard for
`BATON_SILENT_AFTER` seconds is judged: if the run's record still names that trainer and
token, its lease is freed — only while it still names them — and the run handed over
(`shared.state.handover`), so another trainer resumes it now. This is the death nobody
witnessed (a host powered off, a kernel hung, a cable pulled) at the cost of seconds.

No healthy run may be taken for a silence the reaper itself caused. It judges nobody:

- for `BATON_SILENT_AFTER` after it started or reconnected (it may have missed pulses while
  away; every live trainer pulses again within that window);
- while disconnected;
- for a pulse period after a tick of its own came late (its process was starved of CPU, and
  pulses may be waiting unread in its socket).

A trainer that is alive but unheard (its own link cut for longer than the window) loses its
run: its next lease renewal fails and it stops. The lease and the store's token stay the
fence, so such a false alarm costs compute, never correctness. A trainer at a site sends no
pulse and is never judged here: a site trains through a cut of its link.

The cost at the hub: a pulse is about 80 bytes; 10,000 trainers each holding a run at the
default 0.5 s make 20,000 messages a second to one subscriber (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import NamedTuple

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from shared.bus import names
from shared.config import Settings
from shared.contracts import RunState, decode
from shared.contracts.control import Pulse
from shared.errors import ContractError
from shared.state.handover import hand_over
from shared.state.lease import free, lease_key
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


class Heard(NamedTuple):
    at: float
    """When the pulse was heard (this process's monotonic clock)."""
    run_id: str
    token: int


class Silences:
    def __init__(
        self, nc: Client, js: JetStreamContext, runs: Runs, secret: bytes | None,
        settings: Settings,
    ) -> None:  # fmt: skip
        self.nc = nc
        self.js = js
        self.runs = runs
        self.secret = secret
        self.silent_after = settings.silent_after_s
        self.pulse_s = settings.pulse_s
        self.heard: dict[str, Heard] = {}
        """Per trainer: its last pulse."""
        self._deaf_until = 0.0
        self._sub: Subscription | None = None
        self._watch: asyncio.Task[None] | None = None
        self._judging: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if not self.silent_after:
            return  # the watch is off: leases lapse after their TTL
        self.deafened(self.silent_after)
        self._sub = await self.nc.subscribe(names.PULSE_ALL, cb=self._on_pulse)
        self._watch = asyncio.create_task(self._judge_every_tick())

    async def stop(self) -> None:
        tasks = [t for t in (self._watch, *self._judging) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def deafened(self, seconds: float) -> None:
        """Judge nobody for `seconds`: pulses may have been missed until now."""
        self._deaf_until = max(self._deaf_until, time.monotonic() + seconds)

    async def _on_pulse(self, msg: Msg) -> None:
        worker = msg.subject.rpartition(".")[2]
        try:
            p = decode(msg.data, Pulse)
        except ContractError:
            return
        if p.worker == worker:  # a trainer speaks for itself only
            self.heard[worker] = Heard(time.monotonic(), p.run_id, p.token)

    async def _judge_every_tick(self) -> None:
        tick = self.pulse_s / 2
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last > tick + self.pulse_s:
                self.deafened(self.pulse_s)  # this process was starved: read what waits first
            last = now
            if now < self._deaf_until or not self.nc.is_connected:
                continue
            for worker, h in list(self.heard.items()):
                if now - h.at >= self.silent_after:
                    del self.heard[worker]
                    why = f"{worker} was silent for {now - h.at:.1f}s (no pulse)"
                    task = asyncio.create_task(self._judge(worker, h, why))
                    self._judging.add(task)
                    task.add_done_callback(self._judging.discard)

    @property
    def on(self) -> bool:
        return bool(self.silent_after)

    async def departed(self, worker: str, why: str) -> None:
        """`worker`'s connection closed and its process is gone (`departures.py`): judge
        it now, if it pulsed for a run."""
        h = self.heard.pop(worker, None)
        if h is not None:
            await self._judge(worker, h, f"{worker}'s connection closed ({why})")

    async def _judge(self, worker: str, h: Heard, reason: str) -> None:
        try:
            await self.gone(worker, h, reason)
        except Exception:  # the hub busy or electing: judge it again a window later
            log.exception("%s: could not hand over the run of %s", h.run_id, worker)
            self.heard.setdefault(worker, h._replace(at=time.monotonic()))

    async def gone(self, worker: str, h: Heard, reason: str) -> bool:
        """`worker`, which pulsed for `h`, is dead or unheard: hand its run over if the run
        is still in the attempt it pulsed for. True if this call handed it over."""
        found = await self.runs.get(h.run_id)
        if found is None:
            return False
        r = found[0]
        if r.state is not RunState.RUNNING or r.worker != worker or r.token != h.token:
            return False  # the attempt ended (so did its pulse) or was handed over already
        await free(self.js, lease_key(h.run_id, self.secret), worker, h.token)
        return await hand_over(self.nc, self.js, self.runs, h.run_id, h.token, reason)
