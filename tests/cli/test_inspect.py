"""Reading the dead-letter stream, against a real nats-server."""

from __future__ import annotations

from nats.aio.client import Client

from baton.client import inspect


async def test_an_empty_dead_letter_stream_lists_nothing(declared: Client) -> None:
    assert await inspect.dlq(declared) == []
