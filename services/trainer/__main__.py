"""`python -m services.trainer` — run training tasks of one pool.

Shutdown order on SIGTERM (preemption): the running attempt asks its child for a checkpoint,
waits for the commit (up to BATON_GRACE), releases the lease and naks the task so the next
trainer starts at once; only then does the connection drain and close, because every one of
those steps needs NATS. A second SIGTERM skips the wait; the child is killed either way.
"""

from __future__ import annotations

import asyncio

from services.trainer.service import Trainer
from shared import config, telemetry
from shared.connect import connect
from shared.service import StopSignals, setup_logging


async def main() -> None:
    settings = config.load()
    telemetry.setup("baton-trainer")
    signals = StopSignals()
    signals.install()
    holder: list[Trainer] = []

    async def reconnected() -> None:
        if holder:
            await holder[0].on_reconnect()

    nc = await connect(
        settings.nats_url, f"baton-trainer-{settings.worker_id}", on_reconnect=reconnected
    )
    trainer = Trainer(nc, settings, signals)
    holder.append(trainer)
    try:
        await trainer.start()
        await trainer.serve()
    finally:
        await nc.drain()
        telemetry.shutdown()  # last: flushes what the final work recorded


if __name__ == "__main__":
    setup_logging("trainer")
    asyncio.run(main())
