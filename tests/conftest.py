from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from baton.stack.natsserver import NatsServer
from shared.bus.connect import connect
from shared.bus.streams import ensure
from tests.support.helpers import descendants, wait_until_sync
from tests.support.roles import AuthorizedHub


@pytest.fixture(scope="session", autouse=True)
def _local_snapshots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every trainer a test starts keeps its runs' local snapshots (`baton.runtime.local`)
    under the session's temporary directory, never in the host's shared memory."""
    root = tmp_path_factory.mktemp("snapshots")
    before = os.environ.get("BATON_SNAPSHOTS")
    os.environ["BATON_SNAPSHOTS"] = str(root)
    yield
    if before is None:
        os.environ.pop("BATON_SNAPSHOTS", None)
    else:
        os.environ["BATON_SNAPSHOTS"] = before


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


@pytest.fixture
def no_leftover_processes() -> Iterator[None]:
    """The test must leave no process behind; stragglers are killed, then reported.
    Opt-in (`pytestmark`), because long-lived session servers legitimately outlive a test."""
    before = set(descendants())
    yield
    if wait_until_sync(lambda: not set(descendants()) - before, within=5.0):
        return
    left = sorted(set(descendants()) - before)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"processes left behind: {left}")


@pytest.fixture
async def authorized(tmp_path: Path) -> AsyncIterator[AuthorizedHub]:
    """A hub server under `baton up`'s authorization, Baton's streams declared; connect to
    it as a role (`AuthorizedHub.connect`). Its log is audited when it stops."""
    h = AuthorizedHub(tmp_path / "hub")
    await h.start()
    try:
        yield h
    finally:
        await h.stop()
