"""A TCP proxy on loopback that a test can sever and restore, to cut a real NATS link."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open = True
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def sever(self) -> None:
        """Drop every connection now and refuse new ones until `restore()`."""
        self._open = False
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    def restore(self) -> None:
        self._open = True

    async def stop(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, up_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._conns.difference_update((writer, up_w))
