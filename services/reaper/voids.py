"""Voiding holds no run will ever settle: a pending transfer's timeout.

Invariant: credits held for a run's life are given back — its `settle` entry written with
nothing charged (`state` `void`) — when no record of the run exists, live or archived, and
none has for `BATON_VOID_AFTER` (10 minutes: well past a submission's redeliveries) of
this reaper's watch: a submission whose holds were written
and whose record never was (a dispatcher that died in between and a submission never
delivered again, a job of several runs refused half way). Every other held life has a
record, and is settled when its run ends (`billing.py`). A submission delivered again after
its holds were voided finds its life settled and is refused, never trained free
(`shared.ledger.holds.Settled`). The ledger is read whole once every `VOID_EVERY_S`; what
this reaper saw of each orphan, and since when, is its own (a restarted reaper starts
over: later, never sooner).
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client

from shared.contracts.ledger import Hold, Settle
from shared.ledger import book
from shared.ledger.holds import Holds
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")

VOID_EVERY_S = 60.0
"""How often the whole ledger is read for holds without a record."""

Life = tuple[str, str, int]
"""(owner, run id, life)."""


class Voids:
    def __init__(self, nc: Client, runs: Runs, holds: Holds, after_s: float) -> None:
        self.nc = nc
        self.runs = runs
        self.holds = holds
        self.after_s = after_s
        self._seen: dict[Life, float] = {}
        """Each orphan life, and when (monotonic) this reaper first saw it so."""
        self._next = 0.0

    async def sweep(self) -> list[Life]:
        """Once every `VOID_EVERY_S`: void the holds of lives orphaned past `after_s`."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + min(VOID_EVERY_S, self.after_s / 2)
        orphans = {life: units for life, units in (await self._unsettled()).items()
                   if await self.runs.find(life[1]) is None}  # fmt: skip
        self._seen = {life: self._seen.get(life, now) for life in orphans}
        voided = []
        for (owner, run_id, life), since in self._seen.items():
            if now - since < self.after_s:
                continue

            def void(held: int, owner: str = owner, run_id: str = run_id, n: int = life) -> Settle:
                return Settle(owner=owner, run_id=run_id, life=n, held=held, charged=0,
                              state="void")  # fmt: skip

            if await self.holds.settle(owner, run_id, life, void) is not None:
                log.warning("%s: its holds (life %d) had no run for %.0f s: given back to %s",
                            run_id, life, now - since, owner)  # fmt: skip
            voided.append((owner, run_id, life))
        for done in voided:
            self._seen.pop(done, None)
        return voided

    async def _unsettled(self) -> dict[Life, int]:
        """Every life with holds and no settlement, and the units it holds."""
        held: dict[Life, int] = {}
        settled: set[Life] = set()
        for owner, account in (await book.read(self.nc, keep=True)).items():
            for _, e in account.entries:
                if isinstance(e, Hold):
                    at = (owner, e.run_id, e.life)
                    held[at] = held.get(at, 0) + e.amount
                elif isinstance(e, Settle):
                    settled.add((owner, e.run_id, e.life))
        return {life: units for life, units in held.items() if life not in settled}
