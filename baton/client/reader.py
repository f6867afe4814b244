"""Reading a slice of a stream (one run's events or logs) from its first message, then live.

Through a consumer of our own, named, with its filter subject in the API subject
(`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`): that is the one form of consumer
creation the servers' permissions can check, so a submitter may open one on its own runs'
subjects and no other (`shared.auth`). nats-py's ordered consumers carry the filter only in
the request body. The consumer is ephemeral, in memory, unacknowledged, and removed on
`unsubscribe()` — or by the server after `INACTIVE_S` if we died first.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy

from baton.client.patience import patiently

T = TypeVar("T")

INACTIVE_S = 30.0
HEARTBEAT_S = 2.0
"""The server's idle heartbeat to the reader: how a lost consumer is told from a quiet one."""
STALL_S = 3 * HEARTBEAT_S


class StreamReader:
    """Delivers each message of the slice once, in stream order, also across the loss of a
    clustered hub's node: the consumer lives on one node (ephemeral consumers are not
    replicated), so when its heartbeats stop it is made again from the next sequence, and
    whatever a replacement delivers twice is dropped by sequence."""

    def __init__(
        self,
        nc: Client,
        sub: Subscription,
        stream: str,
        config: ConsumerConfig,
        domain: str | None,
        after: int = 0,
    ):
        self._nc = nc
        self._sub = sub
        self._stream = stream
        self._config = config
        self._domain = domain
        self._last = after
        """The stream sequence of the last message delivered (or of the stream's last, for a
        reader of new messages only): a renewal goes on after it."""
        self._heard = asyncio.get_running_loop().time()
        self.pending: int | None = None
        """Messages on the slice when the consumer was made (None: not known)."""

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; `TimeoutError` when none came within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            wait = min(deadline - loop.time(), STALL_S)
            try:
                msg = await self._sub.next_msg(timeout=max(wait, 0.001))
            except TimeoutError:
                if loop.time() - self._heard >= STALL_S:
                    await self._renew()
                if loop.time() >= deadline:
                    raise
                continue
            self._heard = loop.time()
            if (msg.headers or {}).get("Status"):
                continue  # an idle heartbeat (or flow control): the consumer is there
            seq = msg.metadata.sequence.stream
            if seq <= self._last:
                continue
            self._last = seq
            return msg

    async def _renew(self) -> None:
        """A consumer from the message after the last one delivered, in place of one that
        went silent; on failure (no hub to ask yet) the next stall tries again."""
        self._heard = asyncio.get_running_loop().time()
        old = self._config.name
        config = replace(
            self._config,
            name=f"read-{uuid.uuid4().hex[:16]}",
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if self._last else DeliverPolicy.ALL,
            opt_start_seq=self._last + 1 if self._last else None,
        )
        js = self._nc.jetstream(domain=self._domain)
        try:
            await js.add_consumer(self._stream, config)
        except Exception:
            return
        self._config = config
        with contextlib.suppress(Exception):
            await js.delete_consumer(self._stream, old or "")

    async def unsubscribe(self) -> None:
        with contextlib.suppress(Exception):  # the connection may be closing already
            await self._sub.unsubscribe()
        with contextlib.suppress(Exception):
            await self._nc.jetstream(domain=self._domain).delete_consumer(
                self._stream, self._config.name or ""
            )


async def read(
    nc: Client, stream: str, subject: str, domain: str | None = None, new: bool = False
) -> StreamReader:
    """Every message of `stream` on `subject`, from the first — or with `new`, only those
    stored after this call made its consumer (also across a renewal: it goes on from the
    stream's last sequence then); `NotFoundError` if the stream does not exist."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    config = ConsumerConfig(
        filter_subject=subject,
        deliver_subject=inbox,
        deliver_policy=DeliverPolicy.NEW if new else DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=INACTIVE_S,
        idle_heartbeat=HEARTBEAT_S,
        mem_storage=True,
    )

    async def made() -> ConsumerInfo:
        # A new name each try: one whose answer was lost may be placed on a dead node (a
        # consumer nobody reads is removed by the server after INACTIVE_S).
        nonlocal config
        config = replace(config, name=f"read-{uuid.uuid4().hex[:16]}")
        return await nc.jetstream(domain=domain).add_consumer(stream, config)

    try:
        # Only the connected server's own JetStream is waited for (`patience`).
        info = await (patiently(nc, made) if domain is None else made())
    except BaseException:
        await sub.unsubscribe()
        raise
    after = (info.delivered.stream_seq or 0) if new and info.delivered is not None else 0
    reader = StreamReader(nc, sub, stream, config, domain, after)
    reader.pending = info.num_pending
    return reader


async def first(
    sub: StreamReader, wait_s: float, want: Callable[[Msg], T | None]
) -> T | None:
    """The first thing `want` makes of a message `sub` delivers within `wait_s` seconds (it
    returns None for a message that is not the one), or None."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            msg = await sub.next_msg(timeout=left)
        except TimeoutError:
            return None
        if (found := want(msg)) is not None:
            return found
    return None


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
