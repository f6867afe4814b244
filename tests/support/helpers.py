"""Polling and process inspection for the process-layer tests (no fixed sleeps)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.02


async def wait_until(cond: Callable[[], object], within: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what or cond}")
        await asyncio.sleep(POLL_S)


def wait_until_sync(cond: Callable[[], object], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, waiting to be reaped) counts as gone."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(root: int | None = None) -> list[int]:
    """Live processes below `root` (this process by default)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None and st[0] not in ("Z", "X"):
            children.setdefault(st[1], []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
