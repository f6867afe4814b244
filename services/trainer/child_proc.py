"""Starting and talking to training processes: forked by the trainer's zygote (`zygote.py`),
or started from scratch when there is none."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO

from shared.contracts import decode, encode
from shared.contracts.child import FromChild, ToChild

log = logging.getLogger("baton.trainer")

PR_SET_PDEATHSIG = 1
CHILD_MODULE = "services.trainer.child"
FINISH_GRACE_S = 5.0
LOG_TAIL_BYTES = 3000
"""How much of a run's log a failure reports (`tail_of`)."""
OUTPUT_DRAIN_S = 2.0
"""How long an exited child's last output may take to reach its log file."""
"""How long a training process that reported `Finished` may take to exit by itself before
it is stopped. It leaves promptly (`child.leave_promptly`: milliseconds); the grace is for
the user's `atexit` hooks and a loaded machine."""


def _die_with_parent() -> None:
    # The kernel SIGKILLs the process the moment its trainer dies, however it dies: a
    # SIGKILLed trainer can never leave a training process behind that nobody owns.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


class Child:
    """One training process: its control pipes, its output, and its exit code."""

    def __init__(
        self,
        pid: int,
        ctl: IO[bytes],
        reader: asyncio.StreamReader,
        output: asyncio.StreamReader,
        exited: asyncio.Future[int],
    ) -> None:
        self.pid = pid
        self._ctl = ctl
        self._reader = reader
        self._output = output
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has ended (negative: killed by that signal)."""
        return self._exited.result() if self._exited.done() else None

    @classmethod
    async def start(cls, env: dict[str, str]) -> Child:
        """Start a training process from scratch (it imports torch itself)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", CHILD_MODULE, str(to_child_r), str(from_child_w),
            pass_fds=(to_child_r, from_child_w), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        os.close(to_child_r)
        os.close(from_child_w)
        assert proc.stdout is not None
        exited = asyncio.ensure_future(proc.wait())
        reader = await _reader(from_child_r)
        return cls(proc.pid, os.fdopen(to_child_w, "wb", 0), reader, proc.stdout, exited)

    async def copy_output(
        self, log_path: Path, sink: Callable[[bytes], Awaitable[None]] | None = None
    ) -> None:
        """Append the child's stdout and stderr to the run's log file until it exits, and
        hand each chunk to `sink` (the run's log stream), which must not raise."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab", buffering=0) as out:
            while chunk := await self._output.read(65536):
                out.write(chunk)
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
        if self.returncode is None:
            # The child leads its own session; kill the group so nothing it spawned survives.
            # A child forked a moment ago may not lead one yet: then it has spawned nothing,
            # and killing it alone is enough.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)

    async def exit_or_kill(self, grace: float = FINISH_GRACE_S) -> bool:
        """Give the process `grace` seconds to exit by itself, then kill it. Whether it
        exited by itself."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(), grace)
        if self.returncode is not None:
            return True
        self.kill()
        await self.wait()
        return False

    async def wait(self) -> int:
        code = await asyncio.shield(self._exited)
        with contextlib.suppress(BrokenPipeError):
            self._ctl.close()
        return code


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    return reader


class Zygote:
    """The trainer's zygote process and the children it forked (`zygote.py`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._forked: asyncio.Queue[tuple[int, asyncio.Future[int]]] = asyncio.Queue()
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._listening: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._ready = asyncio.Event()

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", CHILD_MODULE, "--zygote", str(theirs.fileno()),
            pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL, env=self.env,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        theirs.close()
        self._sock = ours
        self._forked = asyncio.Queue()
        self._ready = asyncio.Event()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._listening = asyncio.create_task(self._listen(reader))

    async def warm(self) -> None:
        """Wait until the zygote has imported torch (started again if it died): a trainer
        takes no task, and so holds no lease, while its next attempt could not start."""
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self.stop()
                await self.start()
        await self._ready.wait()

    async def fork(self) -> Child:
        """A new training process, forked from the warm zygote; one started from scratch if
        the zygote cannot fork (it is started again for the next one)."""
        async with self._lock:  # one request, one `forked` answer, in order
            for _ in range(2):
                if self._proc is None or self._proc.returncode is not None:
                    if self._proc is not None:
                        log.warning("the zygote exited (%s); starting it again",
                                    self._proc.returncode)  # fmt: skip
                    await self.stop()
                    await self.start()
                child = await self._fork()
                if child is not None:
                    return child
        log.warning("the zygote did not fork; starting a training process from scratch")
        return await Child.start(self.env)

    async def _fork(self) -> Child | None:
        assert self._sock is not None
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            socket.send_fds(self._sock, [b"fork\n"], [to_child_r, from_child_w, out_w])
        except OSError as exc:
            log.warning("could not reach the zygote: %s", exc)
            for fd in (to_child_w, from_child_r, out_r):
                os.close(fd)
            return None
        finally:
            for fd in (to_child_r, from_child_w, out_w):
                os.close(fd)
        pid, exited = await self._forked.get()
        if pid < 0:  # the zygote is gone
            for fd in (to_child_w, from_child_r, out_r):
                os.close(fd)
            return None
        reader = await _reader(from_child_r)
        output = await _reader(out_r)
        return Child(pid, os.fdopen(to_child_w, "wb", 0), reader, output, exited)

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                word, *args = line.decode().split()
                if word == "ready":
                    self._ready.set()
                    continue
                pid = int(args[0])
                if word == "forked":
                    exited = self._exits[pid] = loop.create_future()
                    self._forked.put_nowait((pid, exited))
                elif word == "exited" and (done := self._exits.pop(pid, None)) is not None:
                    done.set_result(int(args[1]))
        # The zygote is gone, and its children died with it (their parent-death signal).
        for done in self._exits.values():
            done.set_result(-signal.SIGKILL)
        self._exits.clear()
        self._forked.put_nowait((-1, loop.create_future()))

    async def stop(self) -> None:
        """Close the zygote's socket: it exits, and any child it forked dies with it."""
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
            self._writer = self._sock = None
        if self._proc is not None and self._proc.returncode is None:
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()
        if self._listening is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._listening
            self._listening = None


def tail_of(path: Path) -> str:
    """The last few KB of a run's log: what a failure reports."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
