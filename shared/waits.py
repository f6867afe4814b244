"""Waiting for an event, bounded, without losing a cancellation.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives just as what it
waits for completes (gh-86296, fixed in 3.12): the cancelled task goes on as if nothing
happened, and whoever awaits it waits forever. Seen here under load: a trainer's stall
watch, woken at every step of the training process, outlived its cancelled attempt, so the
attempt never ended and its trainer kept the run it had been fenced from. `asyncio.timeout`
keeps an outside cancellation apart from its own, so the loops that are cancelled at the
end of an attempt wait with `wait_set`. nats-py's own requests wait with `wait_for`, so a
loop that is cancelled while one is in flight can lose its cancellation there: such a loop
also asks `still_wanted()` at every turn (seen under load: a group leader's watch of its
members' keys outlived its attempt, and its trainer kept a completed run for minutes).
"""

from __future__ import annotations

import asyncio


def still_wanted() -> None:
    """Raise `CancelledError` if the current task was asked to stop, even if an `await`
    since swallowed the cancellation itself (see the module's text)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Until `event` is set (True) or `timeout` seconds have passed (False); a cancellation
    of the caller is always raised."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
