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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, async_playwright

REPO = Path(__file__).resolve().parents[2]


def chromium() -> str:
    """The system's Chromium; `scripts/test.sh` installs it from Debian's packages."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "Chromium is missing: scripts/test.sh installs it (apt-get install chromium)"
    return path


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(
            executable_path=chromium(), headless=True, args=["--no-sandbox"]
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
