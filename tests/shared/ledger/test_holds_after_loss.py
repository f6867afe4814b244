"""Holds after the ledger went back: a hub server that lost the unsynced tail of its streams
(a host crash) comes back with the ledger's sequences lower than the dispatcher's cached
account had read. Its holds must still be taken. Before, the cache was only brought up to
date with the entries after its sequence — none, the ledger being behind it — and every
hold's write, expected at that sequence, was refused: every submission of a priced owner
was answered "credits kept changing under this hold; try again" (found by the fault
campaign, seed 1 of the single-node hub, tests/e2e/test_campaign_single.py)."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client

from baton.stack.natsserver import NatsServer
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.ledger import book
from shared.ledger.holds import Holds
from tests.support.stack import eventually


async def test_a_hold_is_taken_after_the_ledger_went_back(
    nats_server: NatsServer, declared: Client, tmp_path: Path
) -> None:
    js = declared.jetstream()
    assert await book.write(js, TopUp(owner="carol", id="t1", amount=units(10))) is not None
    holds = Holds(declared)
    await holds.take("carol", [Hold(owner="carol", run_id="carol.r1", n=0, amount=units(1))])

    # The store as it is now; then holds the server will lose (the cache reads them).
    await nats_server.stop()
    copy = tmp_path / "copy"
    shutil.copytree(nats_server.store_dir, copy)
    await nats_server.start()
    for i in range(2, 5):
        before = Hold(owner="carol", run_id=f"carol.r{i}", n=0, amount=units(1))
        await eventually(_taking(holds, before), 20, "a hold before the loss")
    await nats_server.kill()
    shutil.rmtree(nats_server.store_dir)
    shutil.copytree(copy, nats_server.store_dir)
    await nats_server.start()

    after = Hold(owner="carol", run_id="carol.r5", n=0, amount=units(1))
    await eventually(_taking(holds, after), 30, "a hold after the loss")
    account = (await book.read(declared, "carol"))["carol"]
    assert account.balance == units(10 - 2), account  # r1's hold and r5's: the rest lost


def _taking(holds: Holds, wanted: Hold) -> Callable[[], Awaitable[bool]]:
    async def took() -> bool:
        try:
            await holds.take(wanted.owner, [wanted])
        except Exception as exc:
            if "kept changing" in str(exc):
                raise  # what the loss used to cause, for good
            return False  # the server still starting
        return True

    return took


async def test_a_settlement_the_hub_lost_is_written_again(
    nats_server: NatsServer, declared: Client, tmp_path: Path
) -> None:
    """The reaper's cached account said the run was settled after the hub lost that very
    settlement with its tail: the run was marked settled with no entry, and its owner never
    got the hold back (found by the fault campaign, seed 1 of the single-node hub)."""
    js = declared.jetstream()
    assert await book.write(js, TopUp(owner="carol", id="t1", amount=units(10))) is not None
    holds = Holds(declared)
    await holds.take("carol", [Hold(owner="carol", run_id="carol.r1", n=0, amount=units(3))])

    def settle(held: int) -> Settle:
        return Settle(owner="carol", run_id="carol.r1", held=held, charged=units(1))

    await nats_server.stop()
    copy = tmp_path / "copy"
    shutil.copytree(nats_server.store_dir, copy)
    await nats_server.start()

    async def first() -> bool:
        try:
            return await holds.settle("carol", "carol.r1", 0, settle) is not None
        except Exception:
            return False  # the server still starting

    await eventually(first, 20, "the settlement before the loss")
    await nats_server.kill()
    shutil.rmtree(nats_server.store_dir)
    shutil.copytree(copy, nats_server.store_dir)
    await nats_server.start()

    async def again() -> bool:
        try:
            return await holds.settle("carol", "carol.r1", 0, settle) is not None
        except Exception:
            return False

    await eventually(again, 30, "the lost settlement written again")
    account = (await book.read(declared, "carol"))["carol"]
    assert account.balance == units(10 - 1) and not account.holds, account
