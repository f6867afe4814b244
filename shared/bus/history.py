"""Reading a run's stored events back, for a service (the CLI and the dashboard have their
own reader, which also follows live events)."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from shared.bus import names
from shared.contracts import decode
from shared.contracts.events import Event
from shared.errors import ContractError

IDLE_S = 1.0


async def run_events(js: JetStreamContext, run_id: str) -> list[Event]:
    """Every event of `run_id` stored so far, in stream order (ones a newer Baton wrote and
    this one cannot read are left out)."""
    sub = await js.subscribe(
        names.events_of_run(run_id),
        stream=names.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    found: list[Event] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=IDLE_S)
            except TimeoutError:
                return found  # none stored at all
            with contextlib.suppress(ContractError):
                found.append(decode(msg.data, Event))
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()
