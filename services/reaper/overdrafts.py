"""Overdrafts: an owner whose balance is below zero by more than the pool's table allows
has the runs nothing was held for paused.

Invariant: a balance goes below zero only by what nobody could hold for — a run submitted
at a site (the site cannot read the ledger while cut off; the hub prices it as it takes it
in, `grants.py`, and charges it when it ends) or a pause at budget that came a checkpoint
late — and an owner whose balance is below their pool's `-overdraft`
(`Pool.overdraft_of`) trains no further on credit: each of their runs that holds nothing
and trains, or waits to, is asked to pause (`transitions.pause_unheld`, reason `budget:
…`; a site's run through its grant, `transitions.forward_requests`), and a `warning`
(`credits_overdrawn`) says so, once per run and life. It stops at its next checkpoint,
losing no step; after a top-up `baton resume` holds what it still needs, as for any run
paused at its budget. Runs with holds train on what they hold (their own meter pauses
them); a submission or a resume is refused on a short balance (the dispatcher). The
overdraft bounds how far *unheld* training goes on once the balance is past it; a run
that ends meanwhile is charged in full (`billing.py`) — what it trained is never given
away, and what it trained is said.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client

from shared.bus.emit import emit
from shared.contracts import RunRecord
from shared.contracts.events import RunWarning
from shared.contracts.pools import UNITS_PER_CREDIT, credits
from shared.ledger.holds import Holds
from shared.state import transitions
from shared.state.policy import Policy
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


class Overdrafts:
    def __init__(self, nc: Client, runs: Runs, holds: Holds, policy: Policy) -> None:
        self.js = nc.jetstream()
        self.runs = runs
        self.holds = holds
        self.policy = policy

    async def sweep(self, records: list[RunRecord]) -> list[str]:
        """Pause every unheld run of an owner past their overdraft; the runs paused."""
        balances: dict[str, int] = {}
        paused = []
        for r in records:
            if not transitions.unheld(r):
                continue
            if r.owner not in balances:
                balances[r.owner] = await self.holds.balance(r.owner)
            balance = balances[r.owner]
            limit = self.policy.table.pool(r.spec.pool).overdraft_of(r.owner)
            if balance >= -round(limit * UNITS_PER_CREDIT):
                continue
            reason = (
                f"budget: {r.owner}'s balance is {credits(balance)} credits, past the "
                f"overdraft of {limit:g} pool {r.spec.pool} allows; top it up and resume it"
            )
            if await self.runs.update(r.run_id, transitions.pause_unheld(reason)) is None:
                continue
            warning = RunWarning(run_id=r.run_id, kind="credits_overdrawn", detail=reason)
            msg_id = f"warning.{r.run_id}.credits_overdrawn.paused.l{r.life}"
            await emit(self.js, warning, msg_id=msg_id)
            log.warning("%s: %s", r.run_id, reason)
            paused.append(r.run_id)
        return paused
