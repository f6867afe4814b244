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
(`service.py`). A run whose events outlived the events stream's retention (its life's
beginning gone) is charged what its trainers metered (`RunRecord.life_metered_s`), never more
than it held: settled, never charged from a part of its events nor left unsettled. A run the
hub ended while a site held its grant waits, like one its site ended, for that site's
outbox to be sourced: what the site trained through a cut is charged.

A run reopened after its settlement (`baton rollback` of a FAILED run) is settled again when
its new life ends, for that life alone: the events after the last life's end, the holds of
that life (`settle.<run>.l<life>`). The settlement is written after the owner's newest
ledger entry (`Holds.settle`), with what the ledger holds for the life then: a hold that
landed before it — one the record never took in, a resume that lost a race with the
run's end — is given back with the rest, and none can land after it.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client

from services.reaper.sites import SiteWatch
from shared import telemetry
from shared.bus.emit import emit
from shared.bus.history import run_history
from shared.contracts import RunRecord
from shared.contracts.events import RunWarning
from shared.contracts.ledger import Settle
from shared.contracts.pools import UNITS_PER_CREDIT, credits
from shared.history.goodput import END
from shared.ledger import book
from shared.ledger.charges import charge, life_events, metered, whole
from shared.ledger.holds import Holds
from shared.state import transitions
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


def billable(r: RunRecord) -> bool:
    """An ended run whose credits are still to settle."""
    return r.state.terminal and bool(r.price) and bool(r.owner) and not r.settled


class Billing:
    def __init__(self, nc: Client, runs: Runs, sites: SiteWatch) -> None:
        self.js = nc.jetstream()
        self.runs = runs
        self.sites = sites
        self.holds = Holds(nc)

    async def sweep(self, records: list[RunRecord]) -> list[str]:
        """Settle every ended run that is due; the runs settled."""
        done = []
        for r in records:
            if not billable(r) or r.announce_pending:
                continue
            site = r.ending_site or r.site
            if site and not await self.sites.caught_up(site):
                # Its last events are still in its site's outbox: also those of a run the
                # hub ended while the site it was granted to trained it through a cut.
                continue
            try:
                if await self.settle(r):
                    done.append(r.run_id)
            except book.NotStored as exc:
                # Unsettled, and marked nothing: the next sweep writes the entry again.
                log.warning("%s: its settlement was not stored (%s); it is written again "
                            "next time round", r.run_id, exc)  # fmt: skip
        return done

    async def settle(self, r: RunRecord) -> bool:
        history, through = await run_history(self.js, r.run_id)
        events = life_events(history, r.life)
        if not whole(history, r.life):
            through = 0
            # The events stream no longer holds the life's beginning (its retention, 30
            # days or 2 GiB, dropped the oldest): charged what its trainers metered, never
            # more than it held, rather than from a part of its events or never.
            spent = metered(r)
            log.warning("%s: its events before its end are gone; charged what its trainers "
                        "metered (%.1f trainer-seconds)", r.run_id, spent.productive_s)  # fmt: skip
        elif not any(isinstance(e, END) for e in events):
            return False  # its terminal event is on its way
        else:
            spent = charge(events, r.price)

        def entry(held: int) -> Settle:
            return Settle(
                owner=r.owner, run_id=r.run_id, life=r.life, held=held, charged=spent.charged,
                productive_s=spent.productive_s, failed_s=spent.failed_s, free_s=spent.free_s,
                state=r.state.value, through=through,
            )  # fmt: skip

        written = await self.holds.settle(r.owner, r.run_id, r.life, entry)
        if written is not None and written.refund < 0:
            await self._overdrawn(r, written)
        await self.runs.update(r.run_id, transitions.settled)
        if written is not None:
            telemetry.CREDITS_CHARGED.add(
                spent.charged / UNITS_PER_CREDIT,
                {telemetry.OWNER: r.owner, telemetry.POOL: r.spec.pool},
            )
            log.info(
                "%s: settled (life %d): %s credits charged of %s held (%.1f productive and "
                "%.1f failed trainer-seconds; %.1f not charged)", r.run_id, r.life,
                credits(spent.charged), credits(written.held), spent.productive_s,
                spent.failed_s, spent.free_s,
            )  # fmt: skip
        return True

    async def _overdrawn(self, r: RunRecord, written: Settle) -> None:
        """A settlement that charged past what the run held (a run submitted at a cut-off
        site holds nothing; a pause at budget can come a checkpoint late) and left its
        owner's balance below zero: said, once, in a `warning` (`credits_overdrawn`) — and
        `baton credits` shows the balance overdrawn."""
        balance = await self.holds.balance(r.owner)
        if balance >= 0:
            return
        detail = (
            f"charged {credits(written.charged)} credits of {credits(written.held)} held: "
            f"{r.owner}'s balance is {credits(balance)}"
        )
        warning = RunWarning(run_id=r.run_id, kind="credits_overdrawn", detail=detail)
        await emit(self.js, warning, msg_id=f"warning.{r.run_id}.credits_overdrawn.l{r.life}")
        log.warning("%s: %s", r.run_id, detail)
