"""Budget warnings: a run with `limits.max_cost` is warned (`warning` events of kinds
`budget_25`, `budget_50`, `budget_75`, `budget_100`) once each as its spend crosses that
share of its budget.

Invariant: a run's spend is what its trainers booked (`RunRecord.actual_cost`: each ended
attempt's seconds at its pool's rate, on the trainer's clock) plus the attempt running now,
as a trainer books it (`services/trainer/attempt.py`, `spent`): its seconds so far at the
pool's rate (the pools' table in force, `shared.state.policy`). Those seconds are the hub
server's now less its stamp of that attempt's `started` event (the one naming the record's
token) — two readings of one clock; an attempt whose `started` is not stored (yet) counts
nothing until it is. At a site, `started` is stamped when the hub sourced it, so a running
attempt's seconds may be counted short after a cut, never long. A pool without a rate costs
nothing, and its runs are never warned.

The warnings are a notice, not a limit: the budget itself is enforced by the hard timeout
the dispatcher derives from it (the seconds `max_cost` buys at the rate), so `budget_100`
and that timeout come at about the same time, and a run failed by the timeout first is
not warned of it.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.contracts import RunRecord, decode
from shared.contracts.events import Started
from shared.errors import ContractError
from shared.state.clock import stamp

log = logging.getLogger("baton.reaper")

SHARES = (25, 50, 75, 100)
KINDS = tuple(f"budget_{p}" for p in SHARES)


def crossed(spent: float, max_cost: float) -> list[str]:
    """The budget warnings a run that spent `spent` of `max_cost` is due (each share of the
    budget reached, at least). None for a budget of 0: nothing can be spent of it."""
    if max_cost <= 0:
        return []
    return [f"budget_{p}" for p in SHARES if spent >= max_cost * p / 100]


def spend(booked: float, running_s: float, rate_per_hour: float) -> float:
    """What a run has cost: `booked` by its ended attempts, plus `running_s` of the running
    one at the pool's rate."""
    return booked + max(0.0, running_s) * rate_per_hour / 3600


async def started_at(js: JetStreamContext, r: RunRecord) -> float | None:
    """The hub server's stamp of the running attempt's `started` event: the run's last one,
    if it names the record's token (one direct read of the events stream)."""
    try:
        msg = await js.get_last_msg(names.EVENTS_STREAM, names.event_subject(r.run_id, "started"))
    except NotFoundError:
        return None
    try:
        started = decode(msg.data or b"", Started)
    except ContractError:
        return None
    return stamp(msg.time) if started.token == r.token else None


def detail(spent: float, max_cost: float, booked: float, running_s: float, rate: float) -> str:
    return (
        f"spent {spent:.4g} of max_cost {max_cost:g} ({100 * spent / max_cost:.0f}%): "
        f"{booked:.4g} booked by ended attempts, and {running_s:.0f}s of the running one "
        f"at {rate:g}/hour"
    )
