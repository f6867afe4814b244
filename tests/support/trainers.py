"""Trainers as the scheduler sees them: heartbeats in the workers bucket, for tests of the
dispatcher alone. A run is admitted — its task published — only while its pool has a live
trainer for it (`services/dispatcher/scheduler.py`); these stand for trainers that would
take the tasks, beating as a trainer does until the block ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

from nats.aio.client import Client

from shared.bus import names
from shared.bus.streams import ensure
from shared.contracts import encode
from shared.contracts.control import WorkerInfo

BEAT_S = 1.0


@contextlib.asynccontextmanager
async def heartbeats(nc: Client, count: int, pool: str = "default") -> AsyncIterator[None]:
    """`count` idle trainers of `pool`, heard every `BEAT_S` while the block runs."""
    js = nc.jetstream()
    await ensure(js)
    names_ = [f"fake-{pool}-{i}" for i in range(count)]

    async def beat() -> None:
        for w in names_:
            info = WorkerInfo(
                worker=w, pool=pool, host="test", pid=os.getpid(), device="cpu", at=time.time()
            )
            await js.publish(
                names.heartbeat_subject(w, ""), encode(info), headers={"Nats-TTL": "6s"}
            )

    async def loop() -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            with contextlib.suppress(Exception):
                await beat()

    await beat()
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
