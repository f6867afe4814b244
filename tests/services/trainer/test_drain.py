"""A trainer's view of being drained (`services/trainer/drain.py`), against a real hub under
`baton up`'s authorization: its key read as the trainer role, `leave` set while drained or
stopping — and never cleared once stopping."""

from __future__ import annotations

import asyncio

from services.trainer.drain import Draining
from shared.contracts.control import Drain
from shared.state.drains import Drains
from tests.support.roles import AuthorizedHub

HANG_S = 30.0
"""A bound against a hang only."""


async def test_leave_follows_the_key_and_stop(authorized: AuthorizedHub) -> None:
    operator = Drains((await authorized.connect("operator")).jetstream())
    stop = asyncio.Event()
    d = Draining((await authorized.connect("trainer")).jetstream(), "t1", stop)
    following = asyncio.create_task(d.follow_stop())
    try:
        assert not await d.read() and not d.drained and not d.leave.is_set()
        await asyncio.wait_for(d.until_undrained(), HANG_S)  # not drained: at once

        await operator.drain(Drain(worker="t1", reason="host out", at=0.0))
        assert await d.read(), "a change is reported"
        assert d.drained and d.leave.is_set()
        assert d.record is not None and d.record.reason == "host out"
        assert not await d.read(), "reading it again changes nothing"
        waiting = asyncio.create_task(d.until_undrained())
        await asyncio.sleep(0)
        assert not waiting.done(), "a drained trainer waits"

        await operator.undrain("t1")
        assert await d.refresh()
        assert not d.drained and not d.leave.is_set()
        await asyncio.wait_for(waiting, HANG_S)

        await operator.drain(Drain(worker="t1", at=0.0))
        await d.read()
        stop.set()  # SIGTERM while drained
        await asyncio.wait_for(following, HANG_S)
        await operator.undrain("t1")
        assert await d.read() and not d.drained
        assert d.leave.is_set(), "a stopping trainer never takes work again"
        await asyncio.wait_for(d.until_undrained(), HANG_S)  # stopping: at once
    finally:
        following.cancel()


async def test_a_failed_read_keeps_what_was_read_last(authorized: AuthorizedHub) -> None:
    operator = Drains((await authorized.connect("operator")).jetstream())
    trainer = await authorized.connect("trainer")
    d = Draining(trainer.jetstream(), "t2", asyncio.Event())
    await operator.drain(Drain(worker="t2", at=0.0))
    assert await d.read() and d.drained
    await trainer.close()  # the hub unreachable from here on
    assert not await d.refresh(), "a failed read is no change"
    assert d.drained and d.leave.is_set()
