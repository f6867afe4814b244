"""Starting and talking to a training child process."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO

from shared.contracts import decode, encode
from shared.contracts.child import FromChild, ToChild

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # The kernel SIGKILLs the child the moment its trainer dies, however it dies: a
    # SIGKILLed trainer can never leave a training process behind that nobody owns.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


class Child:
    def __init__(
        self, proc: asyncio.subprocess.Process, ctl: IO[bytes], reader: asyncio.StreamReader
    ) -> None:
        self.proc = proc
        self._ctl = ctl
        self._reader = reader

    @classmethod
    async def start(cls, env: dict[str, str]) -> Child:
        """Start a child that imports torch and then waits for its `Launch`. Trainers start
        the next one ahead of time, so a run taken over does not wait for the imports."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.trainer.child",
            str(to_child_r),
            str(from_child_w),
            pass_fds=(to_child_r, from_child_w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(from_child_r, "rb", 0)
        )
        return cls(proc, os.fdopen(to_child_w, "wb", 0), reader)

    async def copy_output(
        self, log_path: Path, sink: Callable[[bytes], Awaitable[None]] | None = None
    ) -> None:
        """Append the child's stdout and stderr to the run's log file until it exits, and
        hand each chunk to `sink` (the run's log stream), which must not raise."""
        assert self.proc.stdout is not None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab", buffering=0) as log:
            while chunk := await self.proc.stdout.read(65536):
                log.write(chunk)
                if sink is not None:
                    await sink(chunk)

    def send(self, msg: ToChild) -> None:
        # A child that is gone cannot read; its exit code tells the rest.
        with contextlib.suppress(BrokenPipeError, ValueError):
            self._ctl.write(encode(msg) + b"\n")

    async def messages(self) -> AsyncIterator[FromChild]:
        while line := await self._reader.readline():
            yield decode(line, FromChild)

    def kill(self) -> None:
        if self.proc.returncode is None:
            # The child leads its own session; kill the group so nothing it spawned survives.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def wait(self) -> int:
        code = await self.proc.wait()
        with contextlib.suppress(BrokenPipeError):
            self._ctl.close()
        return code
