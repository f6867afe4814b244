"""Logging in to a test's servers as a person would, and watching what a server does to a
connection (a reload that removes its user closes it)."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.client import Client

from shared.credentials import Credentials, options_for


async def login(url: str, creds: Credentials) -> str:
    """ "ok", or "refused" by the server (any other failure fails the test)."""
    try:
        nc = await asyncio.wait_for(
            nats.connect(url, allow_reconnect=False, connect_timeout=5, **options_for(creds)), 10
        )
    except nats.errors.Error as exc:
        assert "Authorization Violation" in str(exc), repr(exc)
        return "refused"
    await nc.close()
    return "ok"


class Watched:
    """A client that never reconnects, and how often it was disconnected."""

    def __init__(self) -> None:
        self.nc = Client()
        self.disconnects = 0

    async def connect(self, url: str, creds: Credentials) -> Watched:
        async def disconnected() -> None:
            self.disconnects += 1

        await self.nc.connect(
            url, allow_reconnect=False, disconnected_cb=disconnected, **options_for(creds)
        )
        return self
