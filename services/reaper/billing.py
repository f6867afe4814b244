"""Settling runs' credits as they end: charged once, the rest of their holds given back.

Invariant: every ended run with a price (`RunRecord.price`) and an owner gets exactly one
`settle` entry in the ledger (`shared.ledger.book`: write-once, whoever writes it, however
often), and its record is marked `settled` only after that entry is stored — so a reaper
that dies between the two finds the record unsettled, writes the entry again (refused as
the same one) and marks it. The charge is read from the run's events once every one of
them is at the hub — its terminal event stored, and for a run a site ended, the site's
outbox sourced to the end (`sourcing`): a run trained through a cut is metered from what
the site reports at heal — and the holds from the ledger itself (`hold.<run>.<n>`, in
order), so the entry says exactly what the ledger held. A run is retired only once settled
(`service.py`).
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from services.reaper.sites import SiteWatch
from shared import telemetry
from shared.bus import names
from shared.bus.history import run_events
from shared.contracts import RunRecord
from shared.contracts.ledger import Hold, Settle
from shared.contracts.pools import UNITS_PER_CREDIT, credits
from shared.history.goodput import END
from shared.ledger import book
from shared.ledger.charges import charge
from shared.state import transitions
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


def billable(r: RunRecord) -> bool:
    """An ended run whose credits are still to settle."""
    return r.state.terminal and bool(r.price) and bool(r.owner) and not r.settled


class Billing:
    def __init__(self, js: JetStreamContext, runs: Runs, sites: SiteWatch) -> None:
        self.js = js
        self.runs = runs
        self.sites = sites

    async def sweep(self, records: list[RunRecord]) -> list[str]:
        """Settle every ended run that is due; the runs settled."""
        done = []
        for r in records:
            if not billable(r) or r.announce_pending:
                continue
            if r.ending_site and not await self.sites.caught_up(r.ending_site):
                continue  # its last events are still in its site's outbox
            try:
                if await self.settle(r):
                    done.append(r.run_id)
            except book.NotStored as exc:
                # Unsettled, and marked nothing: the next sweep writes the entry again.
                log.warning("%s: its settlement was not stored (%s); it is written again "
                            "next time round", r.run_id, exc)  # fmt: skip
        return done

    async def settle(self, r: RunRecord) -> bool:
        events = await run_events(self.js, r.run_id)
        if not any(isinstance(e, END) for e in events):
            return False  # its terminal event is on its way
        held = await held_for(self.js, r)
        spent = charge(events, r.price)
        entry = Settle(
            owner=r.owner, run_id=r.run_id, held=held, charged=spent.charged,
            productive_s=spent.productive_s, failed_s=spent.failed_s, free_s=spent.free_s,
            state=r.state.value,
        )  # fmt: skip
        written = await book.write(self.js, entry)
        await self.runs.update(r.run_id, transitions.settled)
        if written is not None:
            telemetry.CREDITS_CHARGED.add(
                spent.charged / UNITS_PER_CREDIT,
                {telemetry.OWNER: r.owner, telemetry.POOL: r.spec.pool},
            )
            log.info(
                "%s: settled: %s credits charged of %s held (%.1f productive and %.1f failed "
                "trainer-seconds; %.1f not charged)", r.run_id, credits(spent.charged),
                credits(held), spent.productive_s, spent.failed_s, spent.free_s,
            )  # fmt: skip
        return True


async def held_for(js: JetStreamContext, r: RunRecord) -> int:
    """Units the ledger holds for run `r`: its holds `hold.<run>.0`, `.1`… in order."""
    total, n = 0, 0
    while True:
        found = await book.find(js, names.ledger_subject(r.owner, "hold", f"{r.run_id}.{n}"))
        if not isinstance(found, Hold):
            return total
        total += found.amount
        n += 1
