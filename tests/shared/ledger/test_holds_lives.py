"""Holds and settlements of a run's lives on a real nats-server: a settlement gives back
every hold of its life stored ahead of it, once; no hold of a settled life is taken after
it; the next life holds and is settled on its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from nats.aio.client import Client

from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.ledger import book
from shared.ledger.holds import Holds, Settled

RUN = "erin.r1"


def _settle(life: int, charged: int) -> Callable[[int], Settle]:
    return lambda held: Settle(owner="erin", run_id=RUN, life=life, held=held, charged=charged)


async def test_each_life_is_settled_once_and_nothing_held_after_it(declared: Client) -> None:
    js = declared.jetstream()
    await book.write(js, TopUp(owner="erin", id="t", amount=units(10)))
    holds = Holds(declared)
    assert await holds.take("erin", [Hold(owner="erin", run_id=RUN, n=0, amount=units(2))]) == [
        units(2)
    ]
    # A hold its record never took in (a resume that lost its race with the run's end).
    await holds.take("erin", [Hold(owner="erin", run_id=RUN, n=1, amount=units(1))])
    first = await holds.settle("erin", RUN, 0, _settle(0, units(1)))
    assert first is not None and first.held == units(3), first
    assert await holds.settle("erin", RUN, 0, _settle(0, units(1))) is None  # once
    # Another dispatcher's, whose account has not seen the settlement yet, is refused too.
    for writer in (holds, Holds(declared)):
        with pytest.raises(Settled):
            await writer.take("erin", [Hold(owner="erin", run_id=RUN, n=2, amount=units(1))])
    assert await book.find(js, book.hold_subject("erin", RUN, 0, 2)) is None
    # Its first hold asked again (the run id used again once its record is forgotten): it
    # was given back with the settlement, and holds nothing now.
    for writer in (holds, Holds(declared)):
        with pytest.raises(Settled):
            await writer.take("erin", [Hold(owner="erin", run_id=RUN, n=0, amount=units(2))])
    # Reopened: its second life holds and is settled apart.
    second = Hold(owner="erin", run_id=RUN, n=0, amount=units(4), life=1)
    assert await holds.take("erin", [second]) == [units(4)]
    again = await holds.settle("erin", RUN, 1, _settle(1, units(3)))
    assert again is not None and again.held == units(4), again
    account = (await book.read(declared, "erin"))["erin"]
    assert account.balance == units(10 - 1 - 3) and account.holds == {}, account
    assert account.settled == {(RUN, 0), (RUN, 1)}
