"""The reaper: periodic, idempotent sweeps that keep the run records true.

This first sweep finds **lost runs**: RUNNING, nobody holds the lease, and no task for the
run is left in the queue. That happens when a stale worker's late ack removes the
redelivered copy of a task (NATS-NOTES.md: JetStream accepts such an ack silently), or
when a trainer died between releasing a lease and answering its task. The run record is
the truth, so the run is dispatched again.

Safe with two reapers: the dispatch counter is bumped by a CAS on the run record, and the
new task's `Nats-Msg-Id` is `task.<run>.<dispatch>`, so however the sweeps interleave one
task is stored per bump. A lease can be missing for a moment during a normal hand-over
(released, task about to be nak'ed), so a run counts as lost only once this reaper has
seen it without lease and task for a whole lease TTL, on its own monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared import names
from shared.config import Settings
from shared.connect import publish
from shared.contracts import RunRecord, RunState, Task, encode
from shared.contracts.events import Redispatched
from shared.events import emit
from shared.lease import is_held
from shared.runs import Runs
from shared.streams import ensure

log = logging.getLogger("baton.reaper")


class Reaper:
    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.interval_s = settings.lease_ttl_s / 2
        self._unowned_since: dict[str, float] = {}
        self.runs: Runs

    async def start(self) -> None:
        await ensure(self.js)
        self.runs = await Runs.open(self.js)

    async def serve(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except Exception:  # a link that is down, a server restarting: sweep again later
                log.exception("sweep failed; trying again in %.1fs", self.interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def sweep(self) -> list[str]:
        """One pass; returns the runs dispatched again."""
        redispatched = []
        running = {r.run_id: r for r in await self.runs.all() if r.state is RunState.RUNNING}
        for run_id in list(self._unowned_since):
            if run_id not in running:
                del self._unowned_since[run_id]
        now = time.monotonic()
        for record in running.values():
            if await is_held(self.js, record.run_id) or await self._task_queued(record):
                self._unowned_since.pop(record.run_id, None)
                continue
            since = self._unowned_since.setdefault(record.run_id, now)
            if now - since >= self.settings.lease_ttl_s and await self._redispatch(record):
                redispatched.append(record.run_id)
                self._unowned_since.pop(record.run_id, None)
        return redispatched

    async def _task_queued(self, record: RunRecord) -> bool:
        subject = names.task_subject(record.spec.pool, record.run_id)
        try:
            await self.js.get_last_msg(names.TASKS_STREAM, subject)
        except NotFoundError:
            return False
        return True

    async def _redispatch(self, seen: RunRecord) -> bool:
        def bump(r: RunRecord) -> RunRecord | None:
            if r.state is not RunState.RUNNING or r.dispatch != seen.dispatch:
                return None  # someone else moved it on since we looked
            return msgspec.structs.replace(r, dispatch=r.dispatch + 1, worker=None)

        record = await self.runs.update(seen.run_id, bump)
        if record is None:
            return False
        task = Task(run_id=record.run_id, spec=record.spec, dispatch=record.dispatch)
        await publish(
            self.js,
            names.task_subject(record.spec.pool, record.run_id),
            encode(task),
            msg_id=f"task.{record.run_id}.{record.dispatch}",
        )
        reason = "running, but no lease and no task left in the queue"
        await emit(
            self.js,
            Redispatched(run_id=record.run_id, dispatch=record.dispatch, reason=reason),
            msg_id=f"redispatched.{record.run_id}.{record.dispatch}",
        )
        log.warning("%s: %s; dispatched again (#%d)", record.run_id, reason, record.dispatch)
        return True
