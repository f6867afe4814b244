from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from shared.connect import connect
from shared.natsserver import NatsServer
from shared.streams import ensure


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A real nats-server with JetStream on a free loopback port, one per test."""
    server = NatsServer(tmp_path / "nats", port=0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client of `nats_server`; nothing declared on it yet."""
    client = await connect(nats_server.url, "test", first_attempt_timeout=5)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def declared(nc: Client) -> Client:
    """`nc`, with Baton's streams and buckets declared on its server."""
    await ensure(nc.jetstream())
    return nc
