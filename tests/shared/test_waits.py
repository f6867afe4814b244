"""`wait_set` keeps a cancellation that arrives just as the event is set, where Python
3.11's `asyncio.wait_for` loses it (gh-86296): a loop cancelled that way ran on forever."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from shared.waits import wait_set


async def cancelled_as_set(wait: Callable[[asyncio.Event], Awaitable[object]]) -> bool:
    """A loop waiting on an event, cancelled in the same turn the event is set: whether
    it ended (within a second, far more than it needs)."""
    moved = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait(moved)
            moved.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # it waits now
    moved.set()
    task.cancel()
    await asyncio.wait({task}, timeout=1)
    ended = task.done()
    task.cancel()  # a loop that swallowed the first goes now, at its next wait
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return ended


async def test_a_cancel_as_the_event_is_set_ends_the_loop() -> None:
    assert await cancelled_as_set(lambda e: wait_set(e, 10))


async def test_wait_set_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    event.set()
    assert await wait_set(event, 10)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in Python 3.12")
async def test_wait_for_loses_that_cancel_on_python_3_11() -> None:
    """Why `wait_set` exists: the same loop over `asyncio.wait_for` runs on."""

    async def old(e: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(e.wait(), 10)

    assert not await cancelled_as_set(old)
