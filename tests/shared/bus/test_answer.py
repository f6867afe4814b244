"""A handler's outcome becomes the message's answer, against a real nats-server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import NoStreamResponseError

from shared.bus import answer, names
from shared.errors import PermanentError
from tests.support.sites import stored

Handler = Callable[[Msg], Awaitable[None]]


async def answered(nc: Client, subject: str, handler: Handler) -> Msg | None:
    """Publish one message to a fresh work queue, hand its delivery to `handler` through
    `answer.handle`, and return the next delivery of it within 3 s (None if none came)."""
    js = nc.jetstream()
    stream = subject.replace(".", "_").upper()
    await js.add_stream(
        StreamConfig(name=stream, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE)
    )
    await js.publish(subject, b"job")
    sub = await js.pull_subscribe(subject, durable="worker", stream=stream)
    (msg,) = await sub.fetch(1, timeout=5)
    await answer.handle(js, msg, "worker", handler)
    try:
        (again,) = await sub.fetch(1, timeout=3)
    except TimeoutError:
        return None
    return again


async def test_an_unavailable_stream_is_retried_soon_and_not_dead_lettered(
    declared: Client,
) -> None:
    async def electing(_: Msg) -> None:
        raise NoStreamResponseError

    again = await answered(declared, "t.unavailable", electing)
    assert again is not None and again.metadata.num_delivered == 2, again
    assert not await stored(declared, names.DLQ_STREAM, names.DLQ_ALL)


async def test_a_permanent_error_is_dead_lettered_once_and_never_redelivered(
    declared: Client,
) -> None:
    async def poison(_: Msg) -> None:
        raise PermanentError("not a job")

    assert await answered(declared, "t.poison", poison) is None
    letters = await stored(declared, names.DLQ_STREAM, names.DLQ_ALL)
    assert len(letters) == 1 and b"not a job" in letters[0][1], letters
