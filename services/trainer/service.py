"""The trainer: pulls one task at a time from its pool and runs it under a lease.

The loop holds one task message at a time and answers it only through the outcome of its
attempt (see `attempt.py`). It never cancels a run because NATS went away: the child keeps
training through a blip, and the lease — not the connection — decides who owns the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.trainer.attempt import Attempt, Outcome
from services.trainer.child_proc import Child
from shared import names
from shared.config import Settings
from shared.contracts import Task, decode
from shared.errors import ContractError
from shared.lease import Lease
from shared.outcome import dead_letter
from shared.runs import Runs
from shared.service import StopSignals, pull_loop
from shared.store import Store, open_store
from shared.streams import ensure, ensure_consumer, trainer_consumer

log = logging.getLogger("baton.trainer")


class Trainer:
    def __init__(self, nc: Client, settings: Settings, signals: StopSignals) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.signals = signals
        self.store: Store = open_store(settings.store_url)
        self.runs: Runs
        self.beat_now = asyncio.Event()
        self._spare: Child | None = None
        self._stop_fetching = asyncio.Event()

    async def start(self) -> None:
        await ensure(self.js)
        consumer = trainer_consumer(self.settings.pool, self.settings.ack_wait_s)
        await ensure_consumer(self.js, names.TASKS_STREAM, consumer)
        self.runs = await Runs.open(self.js)
        self._spare = await Child.start(self._child_env())

    async def on_reconnect(self) -> None:
        # Tell the running attempt to touch its task and renew its lease at once: the
        # in_progress sent while the link was down reached nobody.
        self.beat_now.set()

    async def serve(self) -> None:
        async def stop_when_signalled() -> None:
            await self.signals.stop.wait()
            self._stop_fetching.set()

        watcher = asyncio.create_task(stop_when_signalled())
        try:
            await pull_loop(
                self.js,
                names.TASKS_STREAM,
                names.trainer_consumer(self.settings.pool),
                self._stop_fetching,
                self.on_task,
            )
        finally:
            watcher.cancel()
            if self._spare is not None:
                self._spare.kill()
                await self._spare.wait()
            await self.store.close()

    async def on_task(self, msg: Msg) -> None:
        try:
            task = decode(msg.data, Task)
        except ContractError as exc:
            await dead_letter(self.js, msg, "trainer", str(exc))
            await msg.term()
            return
        found = await self.runs.get(task.run_id)
        if found is None:
            await dead_letter(self.js, msg, "trainer", f"no run record for {task.run_id}")
            await msg.term()
            return
        if found[0].state.terminal:
            await msg.ack()  # a duplicate of a run that is already over
            return
        lease = Lease(self.js, task.run_id, self.settings.worker_id, self.settings.lease_ttl_s)
        if not await lease.acquire():
            # Someone holds the run and renews it: this copy is a duplicate. Look again
            # after a third of the TTL, in case the holder has died by then.
            await msg.nak(delay=self.settings.lease_ttl_s / 3)
            return
        outcome = await self._attempt(task, lease, msg)
        await self._answer(msg, outcome, lease)

    async def _attempt(self, task: Task, lease: Lease, msg: Msg) -> tuple[Outcome, float]:
        child = self._spare or await Child.start(self._child_env())
        self._spare = None
        attempt = Attempt(
            self.nc,
            self.settings,
            self.store,
            self.runs,
            task,
            lease,
            child,
            self.signals.stop,
            self.signals.hurry,
            self.beat_now,
        )
        try:
            outcome = await attempt.run(msg.in_progress)
        finally:
            if not self.signals.stop.is_set():
                self._spare = await Child.start(self._child_env())
        return outcome, attempt.retry_delay

    async def _answer(self, msg: Msg, result: tuple[Outcome, float], lease: Lease) -> None:
        outcome, delay = result
        log.info("%s: attempt %s", lease.run_id, outcome.value)
        if outcome in (Outcome.COMPLETED, Outcome.FAILED):
            # The run record already says how it ended, so a lost ack only costs a
            # redelivery that is acked on sight.
            with contextlib.suppress(Exception):
                await msg.ack_sync(timeout=5)
            await lease.release()
        elif outcome is Outcome.PREEMPTED:
            await msg.nak(delay=0)
        elif outcome is Outcome.RETRY:
            await msg.nak(delay=delay)
        # FENCED: the message is not ours to answer any more.

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["BATON_SPOOL"] = str(Path(self.settings.work_dir, "spool").resolve())
        env["PYTHONUNBUFFERED"] = "1"
        # Required by cuBLAS for deterministic results; harmless without a GPU.
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return env
