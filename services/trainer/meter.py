"""A run's credits, spent as it trains: the run pauses when its holds are used up.

Invariant: a run with a price (`RunRecord.price`) trains on no longer than its holds pay
for, as its trainers measure it — the trainer-seconds its ended attempts trained in its
life (`RunRecord.life_metered_s`: a reopened run's holds are its new life's; an attempt
that died without a verdict — its host lost, its lease taken over — counts what it trained
up to its last commit, booked by each commit, which is what it is charged) plus this
attempt's since its training process restored, times its ranks, at its price for this
trainer's device. When they reach its holds the attempt is paused (`budget: …`) at its
next checkpoint, losing no step; `baton resume` after a top-up holds what its holds no
longer cover and goes on. At 80 % a `warning` (`credits_80`) says so first.

What the run is charged is settled from its events once it ends (`shared.ledger.charges`):
its productive seconds and its own failures', never more than this meter counts (which
also counts checkpoint stalls and steps a kill made redo), so a run paused here is never
charged beyond its holds by more than the pause's checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from shared.contracts import RunRecord
from shared.contracts.pools import UNITS_PER_CREDIT, credits

WARN_AT = 0.8


class Meter:
    def __init__(self, record: RunRecord, device: str, ranks: int) -> None:
        self.price = record.price.get(device, record.price.get("*", 0.0))
        """Credits per trainer-second."""
        self.held = record.held
        self.before_s = record.life_metered_s
        self.ranks = max(1, ranks)
        self.began: float | None = None
        self.started = asyncio.Event()

    @property
    def active(self) -> bool:
        return self.price > 0

    def start(self) -> None:
        """The training process restored: its time counts from now."""
        if self.began is None:
            self.began = time.monotonic()
            self.started.set()

    def trained_s(self) -> float:
        """Trainer-seconds this attempt trained so far."""
        return 0.0 if self.began is None else (time.monotonic() - self.began) * self.ranks

    def affordable_s(self) -> float:
        """Trainer-seconds the run's holds pay for, in all."""
        return self.held / UNITS_PER_CREDIT / self.price if self.price > 0 else float("inf")

    async def watch(
        self, pause: Callable[[str], None], warn: Callable[[str], Awaitable[None]]
    ) -> None:
        """Until the holds are spent: warn at `WARN_AT` of them, then `pause` the attempt."""
        if not self.active:
            return
        await self.started.wait()
        warned = False
        while True:
            used = self.before_s + self.trained_s()
            total = self.affordable_s()
            if used >= total:
                pause(
                    f"budget: its hold of {credits(self.held)} credits is spent ({used:.0f} "
                    f"trainer-seconds at {self.price:g}/s); top it up and resume it"
                )
                return
            if not warned and used >= WARN_AT * total:
                warned = True
                await warn(
                    f"{used:.0f} of the {total:.0f} trainer-seconds its hold of "
                    f"{credits(self.held)} credits pays for are spent"
                )
            until = WARN_AT * total if not warned else total
            await asyncio.sleep(max(0.05, (until - used) / self.ranks))
