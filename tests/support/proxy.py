"""A TCP proxy on loopback that a test can sever, blackhole and restore, to cut a real link.

Two faults, because they look different to the peers:

* `sever()` — the link is gone: every connection is reset and new ones are reset on accept,
  so clients notice at once and start reconnecting.
* `blackhole()` — the link is silent: TCP stays open and new connections are accepted, but
  every byte in either direction is read and discarded. Nothing tells the peers; only their
  own liveness checks (NATS ping/pong, read timeouts) can find out. New connections are
  never dialled upstream, so the server does not even learn that someone tried.

`restore()` undoes either. Blackholed connections are aborted on restore rather than
resumed: bytes were dropped mid-stream, so resuming would hand each peer a corrupt protocol
stream; a reset makes them reconnect cleanly, as they would after a real partition.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Literal

_CHUNK = 65536


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._mode: Literal["open", "severed", "blackholed"] = "open"
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def sever(self) -> None:
        """Reset every connection now and refuse new ones until `restore()`."""
        self._mode = "severed"
        self._abort_all()

    def blackhole(self) -> None:
        """Keep connections open but drop every byte, both ways, until `restore()`."""
        self._mode = "blackholed"

    def restore(self) -> None:
        """Pipe new connections again; connections that were blackholed are reset."""
        if self._mode == "blackholed":
            self._abort_all()
        self._mode = "open"

    async def stop(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def _severed(self) -> bool:
        return self._mode == "severed"

    def _abort_all(self) -> None:
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._mode == "severed":
            writer.transport.abort()
            return
        if self._mode == "blackholed":
            self._conns.add(writer)
            with contextlib.suppress(Exception):
                while await reader.read(_CHUNK):
                    pass
            writer.transport.abort()
            self._conns.discard(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        if self._severed():  # cut while we were dialling
            up_w.transport.abort()
            writer.transport.abort()
            return
        self._conns.update((writer, up_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(_CHUNK):
                    # Checked per chunk, so a blackhole also silences links already open.
                    if self._mode == "blackholed":
                        continue
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._conns.difference_update((writer, up_w))
