"""`python -m services.dispatcher` — consume submissions, create runs, publish tasks."""

from __future__ import annotations

import asyncio

from services.dispatcher.service import Dispatcher
from shared import config, telemetry
from shared.connect import connect
from shared.service import StopSignals, setup_logging


async def main() -> None:
    settings = config.load()
    telemetry.setup("baton-dispatcher")
    signals = StopSignals()
    signals.install()
    nc = await connect(settings.nats_url, "baton-dispatcher")
    try:
        dispatcher = Dispatcher(nc, settings)
        await dispatcher.start()
        await dispatcher.serve(signals.stop)
    finally:
        # Drain lets in-flight acks reach the server before the socket closes.
        await nc.drain()
        telemetry.shutdown()  # last: flushes what the final work recorded


if __name__ == "__main__":
    setup_logging("dispatcher")
    asyncio.run(main())
