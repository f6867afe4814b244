"""What every service shares: its `main()`, logging, stop signals, the pull loop."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

from shared import config, telemetry
from shared.backoff import Backoff
from shared.bus.connect import connect, finish
from shared.config import Settings
from shared.signals import StopRequests

log = logging.getLogger("baton.service")


class Service(Protocol):
    async def start(self) -> None: ...
    async def serve(self, stop: asyncio.Event) -> None: ...
    async def on_reconnect(self) -> None: ...
    async def close(self) -> None: ...


def main(name: str, make: Callable[[Client, Settings, StopSignals], Service]) -> None:
    """Run one service until SIGTERM/SIGINT: `python -m services.<name>`."""
    settings = config.load()
    setup_logging(name, settings.log_level)
    asyncio.run(_main(name, make, settings))


async def _main(
    name: str, make: Callable[[Client, Settings, StopSignals], Service], settings: Settings
) -> None:
    telemetry.setup(f"baton-{name}")
    signals = StopSignals()
    signals.install()
    dumping = asyncio.create_task(dump_tasks_on_request())
    made: list[Service] = []

    async def reconnected() -> None:
        if made:
            await made[0].on_reconnect()

    client_name = f"baton-{name}-{settings.worker_id}" if name == "trainer" else f"baton-{name}"
    nc = await connect(settings.nats_url, client_name, on_reconnect=reconnected)
    service = make(nc, settings, signals)
    made.append(service)
    try:
        await service.start()
        await service.serve(signals.stop)
    finally:
        # The service finished its own shutdown in serve(); draining now lets its last acks
        # and events reach the server before the socket closes, then its resources go, and
        # telemetry last, to flush what that final work recorded.
        await finish(nc)
        await service.close()
        dumping.cancel()
        telemetry.shutdown()


# Their DEBUG output prints signed request headers, which carry the S3 access key: never
# below INFO, whatever BATON_LOG_LEVEL says (tests/e2e/test_secrets.py found it).
CHATTY_WITH_SECRETS = ("botocore", "aiobotocore", "boto3", "aioboto3", "urllib3", "s3transfer")


def setup_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in CHATTY_WITH_SECRETS:
        logger = logging.getLogger(noisy)
        logger.setLevel(max(logging.INFO, logger.getEffectiveLevel()))


class StopSignals:
    """SIGTERM/SIGINT handlers that only set state. The first asks for a graceful stop
    (`stop`), a later one says hurry (`hurry`) — but not the same stop delivered twice, as
    when a whole job is signalled and the supervisor relays it too (`shared.signals`)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self._requests = StopRequests(self.stop, self.hurry)

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: self._requests.request(loop.time()))


DUMP_SIGNAL = signal.SIGUSR1


async def dump_tasks_on_request() -> None:
    """On SIGUSR1, log every asyncio task of this process with the stack it waits in: what
    an operator (or a test that timed out) asks of a service that seems stuck. The handler
    only sets an event; the stacks are taken here, on the loop."""
    asked = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(DUMP_SIGNAL, asked.set)
    while True:
        await asked.wait()
        asked.clear()
        tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
        log.warning("%d tasks, as asked (SIGUSR1):", len(tasks))
        for task in tasks:
            out = io.StringIO()
            task.print_stack(limit=12, file=out)
            log.warning("task %s\n%s", task.get_name(), out.getvalue().rstrip())


async def pull_loop(
    js: JetStreamContext,
    stream: str,
    durable: str,
    stop: asyncio.Event,
    handle: Callable[[Msg], Awaitable[None]],
    batch: int = 1,
    concurrency: int = 1,
) -> None:
    """Fetch and handle messages until `stop` is set. A fetch that fails because the link
    is down is retried: the pull subscription works again once NATS is back.

    With `concurrency` above 1, up to that many messages are handled at once, for handlers
    that spend their time waiting on round trips; the next batch is fetched while they run.
    Each message is still answered by its own handler, and a stop waits for those under way:
    nothing fetched is left unhandled but what its AckWait gives back."""
    sub = await js.pull_subscribe_bind(durable, stream)
    delays = Backoff(first=0.2, most=5.0)
    gate = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def gated(msg: Msg) -> None:
        try:
            await handle(msg)
        finally:
            gate.release()

    try:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                continue
            except (ServiceUnavailableError, APIError, ConnectionError) as exc:
                log.warning("fetch from %s/%s failed (%s); retrying", stream, durable, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delays.next())
                continue
            delays.reset()
            if concurrency <= 1:
                for msg in msgs:
                    await handle(msg)
                continue
            for msg in msgs:
                await gate.acquire()  # waits while `concurrency` messages are in hand
                task = asyncio.create_task(gated(msg))
                running.add(task)
                task.add_done_callback(running.discard)
    finally:
        if running:  # handled to the end, also when the loop itself was cancelled
            await asyncio.gather(*running, return_exceptions=True)
        with contextlib.suppress(Exception):  # the connection may be closing already
            await sub.unsubscribe()
