"""Handing a run over the moment its attempt is known to be dead, not after the task's AckWait.

A trainer holds its run's task delivery unanswered for the whole attempt, touching it with
`in_progress` at every lease renewal; JetStream delivers the task again only when it is
answered or when its AckWait (1.5 × the lease TTL) passes untouched. When the holder dies
without answering, whoever learns of it first naks the delivery for it, so the task is
delivered again at once:

    its successor   a trainer started under the same identity in the same work directory
                    (`services/trainer/claim.py`): the old process is certainly gone
    the reaper      the lease expired (`services/reaper/lapses.py`): the holder stayed
                    silent for a whole TTL, so it is fenced whatever it is doing

The record decides, once: `delivery` (the reply subject of the attempt's task delivery) is
cleared by compare-and-swap while the record still names that attempt's token, and only the
writer that cleared it naks and emits `handed_over` (one message id per token,
`names.handover_id`). A nak must never reach a delivery that is not the dead attempt's:
JetStream honours a nak sent to an older delivery of a message that has been delivered again
since, and would hand the task to a third trainer (docs/nats.md). The record's token and
delivery, cleared once, keep the nak to the one delivery that is still outstanding.

Why the shortcut is safe: the new attempt takes the lease with a higher token, and the
checkpoint store refuses every commit of a lower one; a holder that was only silent is fenced
at its next renewal (its lease's revision has moved on) — it can waste compute, never corrupt
the run. And nothing shortcuts a lease still alive: a trainer behind a cut link, or stopped,
keeps its run as long as its lease lives.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.bus import names
from shared.bus.emit import emit
from shared.contracts import RunRecord
from shared.contracts.events import HandedOver
from shared.state import transitions
from shared.state.runs import Runs

log = logging.getLogger("baton.handover")

NAK = b"-NAK"


async def hand_over(
    nc: Client, js: JetStreamContext, runs: Runs, run_id: str, token: int, reason: str,
    site: str = "",
) -> bool:  # fmt: skip
    """Make the task of the dead attempt holding `token` deliverable now. False when there
    is nothing to hand over: the attempt answered its task, the run moved on or is over, or
    someone else handed it over first."""
    taken: list[RunRecord] = []
    clear = transitions.hand_over(token)

    def take(r: RunRecord) -> RunRecord | None:
        new = clear(r)
        if new is not None:
            taken.append(r)  # the delivery to nak is the one the change cleared
        return new

    if await runs.update(run_id, take) is None:
        return False
    held = taken[-1]
    assert held.delivery is not None and held.worker is not None
    await nc.publish(held.delivery, NAK)
    await nc.flush()
    event = HandedOver(run_id=run_id, worker=held.worker, token=token, reason=reason)
    await emit(js, event, msg_id=names.handover_id(run_id, token), site=site)
    log.warning("%s: handed over from %s (token %d): %s", run_id, held.worker, token, reason)
    return True
