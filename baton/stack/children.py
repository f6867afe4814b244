"""What a supervised child is given, and how a supervisor hears it must stop: the
parent-death signal (`child_preexec`: no orphans, whatever kills the parent), the log it
appends to (`open_log`), and SIGINT/SIGTERM as state to act on (`install_stop_signals`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from shared.signals import REPEAT_S, StopRequests

_PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    # Loaded before any fork: the child between fork and exec must not take the import
    # lock or allocate, it may only make the one system call.
    with contextlib.suppress(OSError):
        _libc = ctypes.CDLL(None, use_errno=True)


def child_preexec(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child receive `sig` when its parent dies (Linux).

    The kernel sends it when the *thread* that forked the child exits, not the process, so
    callers must spawn from a thread that lives as long as the children: the event loop's.
    """
    libc = _libc
    if libc is None:
        return None

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        # The parent may have died between fork() and prctl(); then no signal will ever
        # come, and the child would start life as the orphan this exists to prevent.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def install_stop_signals(
    loop: asyncio.AbstractEventLoop,
    stop: asyncio.Event,
    hurry: asyncio.Event | None = None,
    signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM),
    min_gap_s: float = REPEAT_S,
) -> asyncio.Event:
    """First SIGINT/SIGTERM sets `stop`; a later one sets `hurry` (returned, created when
    not given). The handlers only set state: all the work of stopping happens in ordinary
    code, which can await, log and clean up, none of which is safe inside a handler."""
    requests = StopRequests(stop, hurry if hurry is not None else asyncio.Event(), min_gap_s)
    for sig in signals:
        loop.add_signal_handler(sig, lambda: requests.request(loop.time()))
    return requests.hurry


def remove_stop_signals(
    loop: asyncio.AbstractEventLoop, signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM)
) -> None:
    for sig in signals:
        loop.remove_signal_handler(sig)


def open_log(path: Path, header: str | None = None) -> BinaryIO:
    """Opened for appending, so a restarted process's output follows its predecessor's."""
    out = open(path, "ab", buffering=0)  # noqa: SIM115 - the caller closes it
    if header is not None:
        out.write(header.encode() + b"\n")
    return out
