"""The chaos proxy does what its faults promise, checked against a plain echo server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.support.proxy import Proxy

WITHIN_S = 5.0
# How long silence must last to count as "nothing arrives": an echo over loopback takes
# well under a millisecond, so this is hundreds of times what a leak would need to show.
SILENCE_S = 0.3


class Echo:
    """Echoes every byte back and remembers what it received and how often it was dialled."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.accepted = 0
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(4096):
                self.received += data
                writer.write(data)
                await writer.drain()
        writer.close()


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    e = Echo()
    server = await asyncio.start_server(e.serve, "127.0.0.1", 0)
    e.port = server.sockets[0].getsockname()[1]
    try:
        yield e
    finally:
        server.close()
        await server.wait_closed()


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def dial(proxy: Proxy) -> Conn:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy.port), WITHIN_S)


async def echoes(conn: Conn, payload: bytes) -> None:
    reader, writer = conn
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), WITHIN_S)
    assert got == payload, f"echoed {got!r}, sent {payload!r}"


async def reset(conn: Conn) -> bool:
    """Whether the peer closed or reset the connection (waited for up to WITHIN_S)."""
    try:
        data = await asyncio.wait_for(conn[0].read(1), WITHIN_S)
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return data == b""


async def silent(conn: Conn, payload: bytes) -> bool:
    """Whether `payload` goes out and nothing comes back, with the connection still open."""
    reader, writer = conn
    writer.write(payload)
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(1), SILENCE_S)
    except TimeoutError:
        return not writer.is_closing()
    assert not data, f"{data!r} came through a blackhole"
    return False  # EOF: the connection was closed, which a blackhole must not do


async def test_bytes_flow_through(echo: Echo) -> None:
    async with Proxy("127.0.0.1", echo.port) as proxy:
        conn = await dial(proxy)
        await echoes(conn, b"hello")
        assert proxy.url == f"nats://127.0.0.1:{proxy.port}"
        assert proxy.ws_url == f"ws://127.0.0.1:{proxy.port}"


async def test_sever_resets_links_and_refuses_new_ones_until_restored(echo: Echo) -> None:
    async with Proxy("127.0.0.1", echo.port) as proxy:
        conn = await dial(proxy)
        await echoes(conn, b"before")
        proxy.sever()
        assert await reset(conn), "an open link survived sever()"
        assert await reset(await dial(proxy)), "a new link was let through while severed"
        assert echo.accepted == 1
        proxy.restore()
        await echoes(await dial(proxy), b"after")


async def test_blackhole_keeps_links_open_and_drops_every_byte(echo: Echo) -> None:
    async with Proxy("127.0.0.1", echo.port) as proxy:
        old = await dial(proxy)
        await echoes(old, b"before")
        proxy.blackhole()
        assert await silent(old, b"lost-old"), "an open link was not blackholed"
        new = await dial(proxy)
        assert await silent(new, b"lost-new"), "a new link was not blackholed"
        assert echo.accepted == 1, "a blackholed connection was dialled upstream"

        proxy.restore()
        assert await reset(old), "a blackholed link was not reset on restore"
        assert await reset(new), "a link accepted into the blackhole was not reset on restore"
        await echoes(await dial(proxy), b"after")
        assert bytes(echo.received) == b"beforeafter", bytes(echo.received)


async def test_leaving_the_context_stops_it_even_on_failure(echo: Echo) -> None:
    conn: Conn | None = None
    port = 0
    with pytest.raises(RuntimeError, match="test failed"):
        async with Proxy("127.0.0.1", echo.port) as proxy:
            port = proxy.port
            conn = await dial(proxy)
            await echoes(conn, b"x")
            proxy.blackhole()
            raise RuntimeError("test failed")
    assert conn is not None
    assert await reset(conn), "a link outlived the proxy"
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
