"""Waiting for an event, bounded, without losing a cancellation.

Python 3.11's `asyncio.wait_for` can swallow a cancellation that arrives just as what it
waits for completes (gh-86296, fixed in 3.12): the cancelled task goes on as if nothing
happened, and whoever awaits it waits forever. Seen here under load: a trainer's stall
watch, woken at every step of the training process, outlived its cancelled attempt, so the
attempt never ended and its trainer kept the run it had been fenced from. `asyncio.timeout`
keeps an outside cancellation apart from its own, so the loops that are cancelled at the
end of an attempt wait with `wait_set`.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Until `event` is set (True) or `timeout` seconds have passed (False); a cancellation
    of the caller is always raised."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
