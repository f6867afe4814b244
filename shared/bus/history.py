"""Reading a run's stored events back, for a service (the CLI and the dashboard have their
own reader, which also follows live events). The events come back on the hub's clock
(`shared.history.clocks`): what any duration between them is computed from."""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from shared.bus import names
from shared.contracts.events import Event
from shared.history.clocks import from_messages

IDLE_S = 1.0


async def run_events(js: JetStreamContext, run_id: str) -> list[Event]:
    """Every event of `run_id` stored so far, in stream order, each `at` on the hub server's
    clock (ones a newer Baton wrote and this one cannot read are left out)."""
    return (await run_history(js, run_id))[0]


async def run_history(js: JetStreamContext, run_id: str) -> tuple[list[Event], int]:
    """As `run_events`, and the events stream's sequence of the last of them read (0: none):
    what a reader computed from them is of the events up to it, which any later reader can
    select again."""
    sub = await js.subscribe(
        names.events_of_run(run_id),
        stream=names.EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    found: list[Msg] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=IDLE_S)
            except TimeoutError:
                break  # none stored at all
            found.append(msg)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return from_messages(found), (found[-1].metadata.sequence.stream if found else 0)
