"""A real webhook receiver for the notifier's tests: an aiohttp server on a loopback port,
which records every request and answers each path with the status the test sets. It can be
stopped and started again on the same port, as a receiver that was down for a while."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web


class Request:
    def __init__(self, path: str, body: dict[str, Any], headers: dict[str, str], status: int):
        self.path = path
        self.body = body
        self.headers = headers
        self.status = status
        """What the receiver answered."""


class Receiver:
    def __init__(self) -> None:
        self.port = 0
        self.requests: list[Request] = []
        self.answers: dict[str, int] = {}
        """Path → the status it answers (200 when not named)."""
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None

    def url(self, path: str) -> str:
        assert self.port, "start the receiver first"
        return f"http://127.0.0.1:{self.port}{path}"

    async def start(self) -> None:
        """Listen on 127.0.0.1: a free port the first time, the same one after a `stop`."""
        app = web.Application()
        app.router.add_post("/{path:.*}", self._on_post)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listener: the notifier's next POST finds nobody there."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _on_post(self, request: web.Request) -> web.Response:
        status = self.answers.get(request.path, 200)
        body = json.loads(await request.read())
        async with self._changed:
            self.requests.append(Request(request.path, body, dict(request.headers), status))
            self._changed.notify_all()
        return web.Response(status=status, text="ok" if status < 300 else "refused: bad payload")

    def got(self, path: str, pred: Callable[[dict[str, Any]], bool] = lambda _: True) -> int:
        """How many requests to `path` matching `pred` were answered 2xx."""
        return sum(1 for r in self.requests if r.path == path and r.status < 300 and pred(r.body))

    def tried(self, path: str, pred: Callable[[dict[str, Any]], bool] = lambda _: True) -> int:
        """How many requests to `path` matching `pred` came, whatever the answer."""
        return sum(1 for r in self.requests if r.path == path and pred(r.body))

    async def wait(self, check: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Until `check()` holds after a request; `timeout` bounds a hang only."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(check), timeout)
            except TimeoutError:
                shown = [
                    (r.path, r.status, r.body.get("id") or r.body.get("status"))
                    for r in self.requests
                ]
                raise AssertionError(f"timed out waiting for {what}; got {shown}") from None
