"""`baton ui` as a real process, and a real headless browser (Debian's Chromium) to drive it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
from nats.aio.client import Client
from playwright.async_api import Browser, async_playwright

from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[2]


def chromium() -> str:
    """The system's Chromium; `scripts/test.sh` installs it from Debian's packages."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: scripts/test.sh installs it (apt-get install chromium)"
    return path


@contextlib.asynccontextmanager
async def browser(*args: str) -> AsyncIterator[Browser]:
    """Headless Chromium, with `args` on its command line (`--host-resolver-rules=…`)."""
    async with async_playwright() as p:
        b = await p.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox", *args]
        )
        try:
            yield b
        finally:
            await b.close()


class UiProcess:
    """`baton ui` started with `args`; `url` once it listens."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.args = args
        self.cwd = cwd
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.output = ""

    async def start(self) -> str:
        env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
        for key in ("NATS_USER", "NATS_PASSWORD", "NATS_AUTH_FILE", "NATS_CREDS"):
            env.pop(key, None)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "baton", *self.args, cwd=self.cwd, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert self.proc.stdout is not None
        while True:
            line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
            self.output += line
            if not line:
                return ""  # it exited: `exit_code()` and `output` say why
            found = re.search(r"(http://\S+/)", line)
            if found:
                self.url = found.group(1)
                return self.url

    async def exit_code(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        self.output += (await self.proc.stdout.read()).decode()
        return await asyncio.wait_for(self.proc.wait(), 30)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def get(url: str) -> Any:
    def fetch() -> Any:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    return await asyncio.to_thread(fetch)


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hexport = local.partition(":")
                if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


READ_S = 30.0
"""How long a test's HTTP read may wait before the test fails (never a measure)."""


class Reply(msgspec.Struct, frozen=True):
    status: int
    headers: dict[str, str]
    """Lower-case names; a repeated header's values joined by ", "."""
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def request(
    url: str, path: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> Reply:
    """One HTTP/1.1 request to the server at `url`, sent as written (`path` is not
    re-encoded, and `headers` may replace the `Host` that `url` names). An event stream's
    body is not read: its status and headers are the answer."""
    where = urlsplit(url)
    sent = {"Host": where.netloc, "Connection": "close", **(headers or {})}
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        head = "".join(f"{k}: {v}\r\n" for k, v in sent.items())
        writer.write(f"{method} {path} HTTP/1.1\r\n{head}Content-Length: 0\r\n\r\n".encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), READ_S)
        status = int(status_line.split()[1])
        got: dict[str, str] = {}
        while (line := await asyncio.wait_for(reader.readline(), READ_S)) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            key = name.strip().lower()
            got[key] = f"{got[key]}, {value.strip()}" if key in got else value.strip()
        streaming = got.get("content-type", "").startswith("text/event-stream")
        body = b"" if streaming else await asyncio.wait_for(reader.read(), READ_S)
        return Reply(status=status, headers=got, body=body)
    finally:
        writer.close()


async def events(url: str, path: str) -> AsyncGenerator[tuple[str, Any], None]:
    """The Server-Sent Events of `path`, as (event, data) pairs, for as long as the caller
    reads them."""
    where = urlsplit(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {where.netloc}\r\n\r\n".encode())
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), READ_S)).split()[1]
        assert status == b"200", f"{path}: {status!r}"
        kind = ""
        while line := await asyncio.wait_for(reader.readline(), READ_S):
            text = line.decode().rstrip("\r\n")
            if text.startswith("event: "):
                kind = text[7:]
            elif text.startswith("data: ") and kind:
                yield kind, json.loads(text[6:])
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def served(nc: Client, store_url: str | None) -> AsyncIterator[str]:
    """The dashboard served in this process on a free loopback port, over `nc`: its URL."""
    from baton.ui.server import serve

    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(nc, store_url, "127.0.0.1", 0, ready.set_result))
    try:
        yield await asyncio.wait_for(asyncio.shield(ready), 30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class Rig:
    """A dashboard test's world: a stack, its `baton ui` (as the dashboard role) and a
    browser."""

    stack: Stack
    ui: UiProcess
    browser: Browser


@contextlib.asynccontextmanager
async def rigged(root: Path, **stack_options: Any) -> AsyncIterator[Rig]:
    """A stack under `root` (`Stack`'s options), `baton ui` logged in as the dashboard on a
    free port, and a browser; all stopped however the test ends (the stack's audit then
    fails it on any permission refused)."""
    s = Stack(root / "stack", **stack_options)
    ui = UiProcess(
        "--auth-file", str(root / "stack" / "auth" / "dashboard.env"), "ui", "--port", "0",
        "--server", "", "--store", s.store_url, cwd=root,
    )  # fmt: skip
    try:
        await s.start()
        ui.args = tuple(s.nats.url if a == "" else a for a in ui.args)
        assert await ui.start(), f"baton ui did not start:\n{ui.output}"
        async with browser() as b:
            yield Rig(s, ui, b)
    finally:
        await ui.stop()
        await s.stop()
