"""`python -m services.checkpointer` — verify and commit checkpoints."""

from __future__ import annotations

import asyncio

from services.checkpointer.service import Checkpointer
from shared import config, telemetry
from shared.connect import connect
from shared.service import StopSignals, setup_logging


async def main() -> None:
    settings = config.load()
    telemetry.setup("baton-checkpointer")
    signals = StopSignals()
    signals.install()
    nc = await connect(settings.nats_url, "baton-checkpointer")
    checkpointer = Checkpointer(nc, settings)
    try:
        await checkpointer.start()
        await checkpointer.serve(signals.stop)
    finally:
        await nc.drain()
        await checkpointer.store.close()
        telemetry.shutdown()  # last: flushes what the final work recorded


if __name__ == "__main__":
    setup_logging("checkpointer")
    asyncio.run(main())
