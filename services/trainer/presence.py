"""What a trainer says of itself: its heartbeat in the worker registry.

The heartbeat (`WorkerInfo`) is published with a server-side TTL of three periods, so a
trainer that died disappears from the registry by itself; it says what the trainer is (its
pool, host, device), what it runs (run, token, step, rank) and whether it is drained. The
registry is advisory — the scheduler counts free trainers from it, `baton workers` lists
it — so a publish that fails is tried again at the next beat, never retried in place.

Beside it the drain key is read every period (`Draining.refresh`): a change is published at
once (`beat`), and a slow read never holds a heartbeat back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable

from nats.js import JetStreamContext

from services.trainer.attempt import Attempt
from services.trainer.drain import Draining
from services.trainer.rank import Member
from shared import gpus
from shared.bus import names
from shared.bus.connect import publish
from shared.config import Settings
from shared.contracts import encode
from shared.contracts.control import WorkerInfo
from shared.waits import wait_set


class Presence:
    def __init__(
        self, js: JetStreamContext, settings: Settings, draining: Draining,
        running: Callable[[], Attempt | Member | None],
    ) -> None:  # fmt: skip
        self.js = js
        self.settings = settings
        self.draining = draining
        self.running = running
        """What this trainer runs now (an attempt it leads, a rank it holds, or nothing)."""
        self.beat = asyncio.Event()
        """Set to publish the heartbeat now (being drained changed, or the loop went idle)."""
        self.device = local_device()

    async def heartbeat(self) -> None:
        """Publish this trainer's `WorkerInfo` every period, and at once when `beat` is set."""
        ttl = max(2, int(self.settings.heartbeat_s * 3))
        subject = names.heartbeat_subject(self.settings.worker_id, self.settings.site)
        while True:
            info = self.info()
            with contextlib.suppress(Exception):  # the registry is advisory; try again
                await publish(
                    self.js, subject, encode(info), msg_id=f"hb.{info.worker}.{info.at}",
                    headers={"Nats-TTL": f"{ttl}s"}, attempts=1,
                )  # fmt: skip
            await wait_set(self.beat, self.settings.heartbeat_s)
            self.beat.clear()

    def info(self) -> WorkerInfo:
        a = self.running()
        return WorkerInfo(
            worker=self.settings.worker_id, pool=self.settings.pool,
            host=socket.gethostname(), pid=os.getpid(), device=self.device[0],
            gpu_name=self.device[1], gpu_memory_bytes=self.device[2],
            run_id=a.run_id if a else None, token=a.token if a else None,
            step=a.step if a else None, site=self.settings.site, rank=a.rank if a else None,
            drained=self.draining.drained, at=time.time(),
        )  # fmt: skip

    async def follow_drain(self) -> None:
        """Read the drain key every period; a change is published at once."""
        while True:
            if await self.draining.refresh():
                self.beat.set()
            await asyncio.sleep(self.settings.heartbeat_s)


def local_device() -> tuple[str, str, int]:
    """(device, GPU name, GPU memory in bytes) of the GPU this trainer's training processes
    use — the first one its CUDA_VISIBLE_DEVICES lets them see, `cuda:<nvidia-smi index>` —
    or ("cpu", "", 0). Read once, from nvidia-smi: the trainer itself does not import torch."""
    usable = gpus.visible(gpus.host_gpus(), os.environ)
    if not usable:
        return "cpu", "", 0
    gpu = usable[0]
    return f"cuda:{gpu.index}", gpu.name, gpu.memory_bytes
