"""The credits ledger as tests check it: top-ups, and a run's settlement held to its events
and its owner's balance to the unit (docs/scheduling.md, "Credits")."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from nats.aio.client import Client

from shared.bus import names
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.history.goodput import goodput
from shared.ledger import book
from tests.e2e.jobs import history
from tests.support.stack import Stack, eventually


@contextlib.asynccontextmanager
async def priced_stack(
    root: Path, pools: str, people: tuple[str, ...], env: dict[str, str] | None = None
) -> AsyncIterator[Stack]:
    """The hub's services under the pool table `pools` (a priced pool), `people` with their
    own credentials, and two trainers restarted when they die (as under `baton up`), with
    `env` besides; stopped however the test ends."""
    table = root / "pools.toml"
    table.write_text(pools)
    env = {"BATON_POOLS_FILE": str(table), **(env or {})}
    s = Stack(root / "stack", trainers=0, people=people, env=env)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        for name in ("t1", "t2"):
            await s.add_trainer(name, restart=True)
        await s.ready(("trainer",))
        yield s
    finally:
        await s.stop()


async def topup(nc: Client, owner: str, credits: float) -> int:
    """Add `credits` to `owner`'s balance; the units added."""
    entry = TopUp(owner=owner, id=uuid.uuid4().hex, amount=units(credits), by="test")
    assert await book.write(nc.jetstream(), entry) is not None
    return entry.amount


async def balance(nc: Client, owner: str) -> int:
    return (await book.read(nc, owner))[owner].balance


async def settled(nc: Client, owner: str, run_id: str, timeout: float = 90) -> Settle:
    async def found() -> Settle | None:
        subject = names.ledger_subject(owner, "settle", run_id)
        entry = await book.find(nc.jetstream(), subject)
        return entry if isinstance(entry, Settle) else None

    return await eventually(found, timeout, f"{run_id} settled")


async def balanced(
    nc: Client, owner: str, run_id: str, expected_before: int, price: float, ranks: int = 1
) -> Settle:
    """The run's one settlement, checked against its events and the ledger: charged exactly
    its productive and own-failure trainer-seconds at `price`, its holds given back less
    that, its productive seconds its goodput's (times `ranks`); and `owner`'s balance
    `expected_before` (what it was topped up to, less other runs' charges) less the charge,
    to the unit."""
    settle = await settled(nc, owner, run_id)
    account = (await book.read(nc, owner, keep=True))[owner]
    mine = [e for _, e in account.entries if getattr(e, "run_id", None) == run_id]
    holds = [e for e in mine if isinstance(e, Hold)]
    assert [type(e) for e in mine].count(Settle) == 1, mine
    assert holds and settle.held == sum(h.amount for h in holds), (settle, holds)
    assert settle.charged == units((settle.productive_s + settle.failed_s) * price), settle
    assert settle.refund == settle.held - settle.charged
    spent = goodput(await history(nc, run_id))
    assert spent is not None and spent.finished, spent
    assert abs(settle.productive_s - spent.productive_s * ranks) < 1e-6, (settle, spent)
    assert account.balance == expected_before - settle.charged, (account.balance, settle)
    assert run_id not in account.holds, "the run's holds are released"
    return settle
