"""A run followed to its end: its events from the first, live, until the one that ends it.

Invariant: a follower stops exactly when the run has ended, and the run record is the
truth. When the ending event never comes (its writer died after the record's
compare-and-swap, or the stream discarded it), a quiet spell of `quiet_s` makes the
follower read the record, and a terminal record ends the follow instead. `baton watch`
and the Python API's `Run.watch` and `Run.wait` (`baton.client.api`) follow runs here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.aio.client import Client

from baton.client import calls
from shared.contracts import RunRecord
from shared.contracts.events import Cancelled, Completed, Event, Failed, Rejected

QUIET_S = 2.0
"""Seconds without an event after which a follower looks at the run record."""


def ending(event: Event) -> bool | None:
    """True for the event of a run that completed; False for one that failed, was
    cancelled or was rejected; None for any event that ends nothing."""
    if isinstance(event, Completed):
        return True
    if isinstance(event, Failed | Cancelled | Rejected):
        return False
    return None


async def until_end(
    nc: Client, run_id: str, quiet_s: float = QUIET_S
) -> AsyncIterator[Event | RunRecord]:
    """The run's events up to and with the one that ends it; after a quiet spell, its
    record instead if that is terminal (and then nothing more)."""
    async for event in calls.follow(nc, run_id, quiet_s):
        if event is not None:
            yield event
            if ending(event) is not None:
                return
            continue
        found = await calls.record(nc, run_id)
        if found.state.terminal:
            yield found
            return
