from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.natsserver import NatsServer


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A real nats-server with JetStream on a free loopback port, one per test."""
    server = NatsServer(tmp_path / "nats", port=0)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
