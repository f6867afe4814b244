"""Reading a slice of a stream (one run's events or logs) from its first message, then live.

Through a consumer of our own, named, with its filter subject in the API subject
(`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`): that is the one form of consumer
creation the servers' permissions can check, so a submitter may open one on its own runs'
subjects and no other (`shared.auth`). nats-py's ordered consumers carry the filter only in
the request body. The consumer is ephemeral, in memory, unacknowledged, and removed on
`unsubscribe()` — or by the server after `INACTIVE_S` if we died first.
"""

from __future__ import annotations

import contextlib
import uuid

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

INACTIVE_S = 30.0


class StreamReader:
    def __init__(self, nc: Client, sub: Subscription, stream: str, name: str, domain: str | None):
        self._nc = nc
        self._sub = sub
        self._stream = stream
        self._name = name
        self._domain = domain

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; `TimeoutError` when none came within `timeout` seconds."""
        return await self._sub.next_msg(timeout=timeout)

    async def unsubscribe(self) -> None:
        with contextlib.suppress(Exception):  # the connection may be closing already
            await self._sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._nc.jetstream(domain=self._domain).delete_consumer(self._stream, self._name)


async def read(nc: Client, stream: str, subject: str, domain: str | None = None) -> StreamReader:
    """Every message of `stream` on `subject`, from the first; `NotFoundError` if the
    stream does not exist."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    name = f"read-{uuid.uuid4().hex[:16]}"
    config = ConsumerConfig(
        name=name,
        filter_subject=subject,
        deliver_subject=inbox,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=INACTIVE_S,
        mem_storage=True,
    )
    try:
        await nc.jetstream(domain=domain).add_consumer(stream, config)
    except BaseException:
        await sub.unsubscribe()
        raise
    return StreamReader(nc, sub, stream, name, domain)


async def drain(sub: StreamReader, idle_s: float = 1.0) -> list[Msg]:
    """Every message stored so far: stops at the newest (by the consumer's pending count),
    or after `idle_s` without one."""
    out: list[Msg] = []
    while True:
        try:
            msg = await sub.next_msg(timeout=idle_s)
        except TimeoutError:
            return out
        out.append(msg)
        if msg.metadata.num_pending == 0:
            return out
