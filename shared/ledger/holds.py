"""Holding a run's estimated cost as it is accepted (or resumed), against its owner's credits.

The estimate: the run's steps still to train times the median seconds per step of the last
completed runs of the same job name in its pool (`Pools.job_step_s`), else the job's own
`estimate_s` (for the share of its steps still to train), times its ranks — or, for a run
resumed after it trained, its own trainer-seconds per step so far — times the pool's
`estimate_margin`, at the pool's dearest price (the trainer it gets is not known yet; the
settlement charges the real one). A pool with a price and a job with neither is refused:
nothing would bound what it spends.

Holds of one owner are taken one at a time in this process, each a compare-and-swap on the
owner's newest ledger entry (`book.write(after=…)`): a balance read once is never spent
twice, by this dispatcher or another. So is a settlement (`Holds.settle`), and a hold is
taken only while its run's life is not settled in the account it was checked against: a
hold and the settlement of its life are ordered by the ledger itself, so no hold ever
lands after its life's settlement (which would hold credits nobody gives back), and the
settlement gives back every hold stored ahead of it — one the run's record never took in
(its resume lost a race with the run's end) too. Like a pending transfer: the settlement
posts what the life is charged and voids the rest, once.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.contracts.jobs import JobSpec
from shared.contracts.ledger import Hold, Settle
from shared.contracts.pools import Pool, credits, units
from shared.errors import ContractError
from shared.ledger import book
from shared.state.pools import Pools

TRIES = 5


@dataclass(frozen=True)
class Estimate:
    trainer_s: float
    amount: int
    """Units to hold."""
    how: str


async def reckon(
    pools: Pools, spec: JobSpec, pool: Pool, steps: int, own: tuple[float, int] | None = None
) -> Estimate:
    """What `steps` more steps of `spec` will cost, held (the module's docstring). `own`:
    the trainer-seconds the run itself took for how many steps, which a run resumed after
    training a while knows best."""
    ranks = spec.max_ranks
    if own is not None and own[0] > 0 and own[1] > 0:
        trainer_s = steps * own[0] / own[1]
        how = f"{steps} steps x {own[0] / own[1]:.3g} trainer-s/step (its own so far)"
        return _held(trainer_s, how, pool)
    step_s = await pools.job_step_s(spec.pool, spec.name)
    if step_s is not None:
        trainer_s = steps * step_s * ranks
        how = (
            f"{steps} steps x {step_s:.3g} s/step (the median of earlier {spec.name!r} runs) "
            f"x {ranks} rank(s)"
        )
    elif spec.estimate_s is not None:
        trainer_s = spec.estimate_s * steps / spec.total_steps * ranks
        how = f"estimate_s {spec.estimate_s:g} x {steps}/{spec.total_steps} steps x {ranks} rank(s)"
    else:
        raise ContractError(
            f"pool {spec.pool!r} charges credits and no earlier {spec.name!r} run measured "
            "its step time: give the job an estimate_s (seconds it will train)",
            "$.estimate_s",
        )
    return _held(trainer_s, how, pool)


def _held(trainer_s: float, how: str, pool: Pool) -> Estimate:
    price = pool.dearest()
    amount = units(trainer_s * pool.estimate_margin * price)
    how += f" x margin {pool.estimate_margin:g} at {price:g} credits/s = {credits(amount)} credits"
    return Estimate(trainer_s, amount, how)


def shortfall(amount: int, held: int, metered_s: float, price: dict[str, float]) -> int:
    """Units a run must hold more to train on for an estimate of `amount` units, when its
    life holds `held` and has trained `metered_s` trainer-seconds (at its dearest price, as
    estimates are reckoned): the estimate less what its holds still cover; 0 when they do."""
    spent = units(metered_s * max(price.values(), default=0.0))
    return max(0, amount - (held - spent))


class Short(ContractError):
    """The owner's balance does not cover the holds asked for."""


class Settled(ContractError):
    """The run's life is settled: nothing is held for it any more."""


class Holds:
    """The dispatcher's holds, and the balances it checks them against."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self._accounts: dict[str, book.Account] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def take(self, owner: str, wanted: list[Hold]) -> list[int]:
        """Take every hold of `wanted` not taken yet (a submission delivered again finds
        its own), all or none; the units each holds as stored (a hold taken before keeps
        its amount). `Short`, naming the balance and what was asked, when the owner's
        balance does not cover them; `Settled` when a run's life is settled already — a
        hold stored before included: it was given back with the settlement, and holds
        nothing now (a run id used again once its record is forgotten)."""
        async with self._locks[owner]:
            missing = [h for h in wanted if await book.find(self.js, book.subject_of(h)) is None]
            for _ in range(TRIES):
                account = await self._account(owner)
                over = [h for h in wanted if (h.run_id, h.life) in account.settled]
                if over and not await self._settled(over[0]):
                    self._accounts.pop(owner, None)  # a settlement the hub lost: read again
                    continue
                if over:
                    raise Settled(
                        f"run {over[0].run_id} is settled (life {over[0].life}): "
                        "nothing is held for it any more", "$.run_id",
                    )  # fmt: skip
                if not missing:
                    return [await self._stored(h) for h in wanted]
                need = sum(h.amount for h in missing)
                if account.balance < need:
                    why = "; ".join(h.estimate for h in missing)
                    raise Short(
                        f"{owner}'s balance of {credits(account.balance)} credits is short of "
                        f"the {credits(need)} this run holds ({why}); an operator tops it up "
                        f"(`baton credits topup {owner} N`)",
                        "$.estimate_s",
                    )
                try:
                    while missing:
                        seq = await book.write(self.js, missing[0], after=account.last_seq)
                        hold = missing.pop(0)
                        if seq is None:
                            # Stored before (a first try whose answer was lost): it is
                            # read with the owner's entries since, not counted twice here.
                            break
                        account.fold(seq, hold)
                except book.Moved:
                    # Read the owner's account whole again, not only the entries since: the
                    # ledger may have gone back (a hub server that lost the unsynced tail of
                    # its streams), and then none come after the sequence kept, which the
                    # ledger will not reach again before a write at it succeeds.
                    self._accounts.pop(owner, None)
                    continue
            raise ContractError(f"{owner}'s credits kept changing under this hold; try again")

    async def _settled(self, hold: Hold) -> bool:
        """Whether the ledger holds the settlement of `hold`'s life, as the stream stands."""
        subject = book.settle_subject(hold.owner, hold.run_id, hold.life)
        return await book.find(self.js, subject) is not None

    async def _stored(self, hold: Hold) -> int:
        found = await book.find(self.js, book.subject_of(hold))
        return found.amount if isinstance(found, Hold) else hold.amount

    async def settle(
        self, owner: str, run_id: str, life: int, entry: Callable[[int], Settle]
    ) -> Settle | None:
        """Settle life `life` of `owner`'s run `run_id` once: `entry(held)` — `held` the
        units the ledger holds for the life as the settlement is written, every one of its
        holds stored ahead of it — written after the owner's newest entry (a hold landing
        meanwhile makes it read again). The entry written, or None when the life was
        settled before. `book.NotStored` when the store refused it."""
        async with self._locks[owner]:
            for _ in range(TRIES):
                account = await self._account(owner)
                if (run_id, life) in account.settled:
                    subject = book.settle_subject(owner, run_id, life)
                    if await book.find(self.js, subject) is not None:
                        return None
                    # The account this process folded holds a settlement the stream no
                    # longer has (the hub lost the unsynced tail of its ledger): read it
                    # whole again, and settle.
                    self._accounts.pop(owner, None)
                    continue
                settle = entry(account.holds.get(run_id, 0))
                try:
                    seq = await book.write(self.js, settle, after=account.last_seq)
                except book.Moved:
                    self._accounts.pop(owner, None)
                    continue
                if seq is None:
                    return None  # a first try whose answer was lost
                account.fold(seq, settle)
                return settle
            raise book.NotStored(f"{owner}'s credits kept changing under {run_id}'s settlement")

    async def balance(self, owner: str) -> int:
        """`owner`'s balance as this process last read it, with the entries since."""
        async with self._locks[owner]:
            return (await self._account(owner)).balance

    async def _account(self, owner: str) -> book.Account:
        """`owner`'s account: read whole once, then only the entries since."""
        cached = self._accounts.get(owner)
        if cached is None:
            cached = (await book.read(self.nc, owner))[owner]
            self._accounts[owner] = cached
            return cached
        for seq, entry in await book.since(self.nc, owner, cached.last_seq):
            cached.fold(seq, entry)
        return cached
