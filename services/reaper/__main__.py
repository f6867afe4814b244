"""`python -m services.reaper` — sweep for runs the queue has lost."""

from __future__ import annotations

import asyncio

from services.reaper.service import Reaper
from shared import config, telemetry
from shared.connect import connect
from shared.service import StopSignals, setup_logging


async def main() -> None:
    settings = config.load()
    telemetry.setup("baton-reaper")
    signals = StopSignals()
    signals.install()
    nc = await connect(settings.nats_url, "baton-reaper")
    reaper = Reaper(nc, settings)
    try:
        await reaper.start()
        await reaper.serve(signals.stop)
    finally:
        await nc.drain()
        await reaper.store.close()
        telemetry.shutdown()  # last: flushes what the final work recorded


if __name__ == "__main__":
    setup_logging("reaper")
    asyncio.run(main())
