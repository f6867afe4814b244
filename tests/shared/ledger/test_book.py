"""The credits ledger on a real nats-server: an entry is stored once however often it is
written, a hold is refused when the owner's entries moved since the balance it was checked
against, reads fold exactly the entries stored, holds are all or none, and the stream
refuses deletes and purges."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from shared.bus import names
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.ledger import book
from shared.ledger.holds import Holds, Short


async def test_an_entry_is_stored_once_whoever_writes_it(declared: Client) -> None:
    js = declared.jetstream()
    top = TopUp(owner="alice", id="t1", amount=units(3))
    first = await book.write(js, top)
    assert first is not None
    # Again, twice at once, and after its message id's window would have let it through.
    again = await asyncio.gather(book.write(js, top), book.write(js, top))
    assert list(again) == [None, None], again
    assert await book.find(js, book.subject_of(top)) == top
    account = (await book.read(declared, "alice"))["alice"]
    assert account.balance == units(3) and account.last_seq == first


async def test_a_hold_is_refused_when_the_owners_entries_moved(declared: Client) -> None:
    js = declared.jetstream()
    seq = await book.write(js, TopUp(owner="bob", id="t1", amount=units(1)))
    assert seq is not None
    await book.write(js, TopUp(owner="bob", id="t2", amount=units(1)))  # moved since `seq`
    hold = Hold(owner="bob", run_id="bob.r1", n=0, amount=units(1))
    with pytest.raises(book.Moved):
        await book.write(js, hold, after=seq)
    assert await book.find(js, book.subject_of(hold)) is None
    latest = (await book.read(declared, "bob"))["bob"].last_seq
    assert await book.write(js, hold, after=latest) is not None
    # Another owner's entries never move bob's.
    await book.write(js, TopUp(owner="carol", id="t1", amount=units(1)))
    hold2 = Hold(owner="bob", run_id="bob.r2", n=0, amount=units(1))
    assert await book.write(js, hold2, after=latest + 1) is not None


async def test_reads_fold_holds_and_settlements(declared: Client) -> None:
    js = declared.jetstream()
    await book.write(js, TopUp(owner="dan", id="t", amount=units(10)))
    await book.write(js, Hold(owner="dan", run_id="dan.r1", n=0, amount=units(4)))
    await book.write(js, Hold(owner="dan", run_id="dan.r2", n=0, amount=units(2)))
    await book.write(js, Settle(owner="dan", run_id="dan.r1", held=units(4), charged=units(1)))
    accounts = await book.read(declared, keep=True)
    dan = accounts["dan"]
    assert dan.balance == units(10 - 4 - 2 + 3), dan.balance
    assert dan.holds == {"dan.r2": units(2)} and len(dan.entries) == 4
    # From a sequence on: only what came after.
    later = await book.since(declared, "dan", dan.entries[1][0])
    assert [e.kind for _, e in later] == ["hold", "settle"], later


async def test_holds_are_all_or_none_and_a_repeat_takes_nothing(declared: Client) -> None:
    js = declared.jetstream()
    holds = Holds(declared)
    await book.write(js, TopUp(owner="eve", id="t", amount=units(5)))
    wanted = [Hold(owner="eve", run_id=f"eve.r{i}", n=0, amount=units(2)) for i in range(3)]
    with pytest.raises(Short, match="balance of 5 credits is short of the 6"):
        await holds.take("eve", wanted)
    assert (await book.read(declared, "eve"))["eve"].balance == units(5), "nothing taken"
    await holds.take("eve", wanted[:2])
    await holds.take("eve", wanted[:2])  # the same submission delivered again
    assert (await book.read(declared, "eve"))["eve"].balance == units(1)


async def test_an_entry_a_newer_baton_wrote_stops_nothing(declared: Client) -> None:
    """An entry this version cannot read — the owner's newest — is counted and left out of
    the sums: holds and settlements for the owner go on, each written after it."""
    js = declared.jetstream()
    await book.write(js, TopUp(owner="alice", id="t1", amount=units(3)))
    newer = b'{"kind":"grant","owner":"alice","id":"g1","amount":5}'
    subject = names.ledger_subject("alice", "grant", "g1")
    await js.publish(subject, newer, headers={"Nats-Msg-Id": subject})
    holds = Holds(declared)
    hold = Hold(owner="alice", run_id="alice.r1", n=0, amount=units(1))
    assert await holds.take("alice", [hold]) == [units(1)]
    await js.publish(names.ledger_subject("alice", "grant", "g2"), newer)  # the newest again

    def entry(held: int) -> Settle:
        return Settle(owner="alice", run_id="alice.r1", held=held, charged=units(0.5))

    settled = await holds.settle("alice", "alice.r1", 0, entry)
    assert settled is not None and settled.held == units(1), settled
    account = (await book.read(declared, "alice"))["alice"]
    assert account.unreadable == 2 and account.balance == units(3 - 0.5), account


REFUSED = r"(?i)(delete|purge).*not permitted|not permitted.*(delete|purge)"


async def test_the_ledger_refuses_deletes_and_purges(declared: Client) -> None:
    """Append-only by the stream's own rule, not by habit: a message deleted or the stream
    purged — by a client with every right — is refused, and the owner's entries stay."""
    js = declared.jetstream()
    seq = await book.write(js, TopUp(owner="gail", id="t1", amount=units(2)))
    assert seq is not None
    with pytest.raises(Exception, match=REFUSED):
        await js.delete_msg(names.LEDGER_STREAM, seq)
    with pytest.raises(Exception, match=REFUSED):
        await js.purge_stream(names.LEDGER_STREAM)
    with pytest.raises(Exception, match=REFUSED):
        await js.purge_stream(names.LEDGER_STREAM, subject=book.subject_of(
            TopUp(owner="gail", id="t1", amount=units(2))
        ))  # fmt: skip
    assert (await book.read(declared, "gail"))["gail"].balance == units(2)
