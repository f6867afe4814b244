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

`accepted` counts the connections piped through to the target and `refused` the dials reset
while severed, so a test can tell how often its peers reconnected. `tests/support/link.py`
adds delay, jitter, a bandwidth cap and flapping on top (`_pipe` is what it replaces).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Literal, Self

_CHUNK = 65536


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._mode: Literal["open", "severed", "blackholed"] = "open"
        self._conns: set[asyncio.StreamWriter] = set()
        self.accepted = 0
        """Connections piped through to the target (the peers' dials, reconnects included)."""
        self.refused = 0
        """Dials reset on accept because the link was severed."""
        self._handlers: set[asyncio.Task[None]] = set()

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
        # Every connection was reset: let their handlers finish rather than be cancelled
        # with the event loop (asyncio logs those as errors).
        if handlers := {t for t in self._handlers if not t.done()}:
            await asyncio.wait(handlers, timeout=5)

    async def __aenter__(self) -> Self:
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
        if (me := asyncio.current_task()) is not None:
            self._handlers.add(me)
            me.add_done_callback(self._handlers.discard)
        if self._mode == "severed":
            self.refused += 1
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
        self.accepted += 1
        self._conns.update((writer, up_w))
        await asyncio.gather(self._pipe(reader, up_w, up=True), self._pipe(up_r, writer, up=False))
        self._conns.difference_update((writer, up_w))

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        """Copy one direction of a connection (`up`: towards the target) until either end
        goes, then reset the other."""
        with contextlib.suppress(Exception):
            while data := await src.read(_CHUNK):
                # Checked per chunk, so a blackhole also silences links already open.
                if self._mode == "blackholed":
                    continue
                dst.write(data)
                await dst.drain()
        dst.transport.abort()
