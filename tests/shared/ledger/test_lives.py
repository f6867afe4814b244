"""A run's lives in the ledger, without NATS: each life's entries under identities of its
own (life 0's as before lives), the events of one life charged alone, a resume holding
only what its holds no longer cover, and the checks of `baton verify` per life."""

from __future__ import annotations

from shared.contracts import encode
from shared.contracts import events as ev
from shared.contracts.ledger import Hold, Settle, TopUp
from shared.contracts.pools import units
from shared.history.accounts import ledger_sums, nothing_after_settle, settled_once
from shared.history.facts import History, Posted
from shared.ledger import book
from shared.ledger.charges import life_events, whole
from shared.ledger.holds import shortfall

RUN = "alice.r1"


def test_each_life_has_identities_of_its_own_and_life_0_keeps_the_old_ones() -> None:
    first = Hold(owner="alice", run_id=RUN, n=1, amount=5)
    again = Hold(owner="alice", run_id=RUN, n=1, amount=5, life=2)
    assert book.subject_of(first) == f"baton.ledger.alice.hold.{RUN}.1"
    assert book.subject_of(again) == f"baton.ledger.alice.hold.{RUN}.l2.1"
    assert book.subject_of(Settle(owner="alice", run_id=RUN, held=5, charged=1)) == (
        f"baton.ledger.alice.settle.{RUN}"
    )
    assert book.subject_of(Settle(owner="alice", run_id=RUN, held=5, charged=1, life=1)) == (
        f"baton.ledger.alice.settle.{RUN}.l1"
    )
    # Life 0's entries are written as they were before lives: no `life` field.
    assert b'"life"' not in encode(first) and b'"life":2' in encode(again)


def test_an_account_knows_which_lives_are_settled() -> None:
    a = book.Account("alice")
    a.fold(1, Hold(owner="alice", run_id=RUN, n=0, amount=10))
    a.fold(2, Settle(owner="alice", run_id=RUN, held=10, charged=4))
    a.fold(3, Hold(owner="alice", run_id=RUN, n=0, amount=7, life=1))
    assert a.settled == {(RUN, 0)} and a.holds == {RUN: 7} and a.balance == -11


def test_a_resume_holds_only_what_its_holds_no_longer_cover() -> None:
    price = {"cpu": 0.01, "cuda": 0.02}
    # 100 units held, 20 trainer-s at the dearest 0.02 spent: 60 still cover 60 wanted.
    assert shortfall(units(0.6), units(1.0), 20.0, price) == 0
    assert shortfall(units(0.9), units(1.0), 20.0, price) == units(0.3)
    # Spent past its holds (a pause comes late): the overage is held too.
    assert shortfall(units(0.5), units(1.0), 60.0, price) == units(0.7)


def test_each_life_is_charged_its_own_events_only() -> None:
    e = [
        ev.Accepted(run_id=RUN, at=1.0, name="n", pool="p", total_steps=5),
        ev.Failed(run_id=RUN, reason="boom", at=5.0),
        ev.Progress(run_id=RUN, worker="s1", step=3, total_steps=5, at=4.0),  # a site's, late
        ev.Reopened(run_id=RUN, life=1, step=2, at=6.0),
        ev.Resumed(run_id=RUN, reason="back", at=6.0),
        ev.Completed(run_id=RUN, at=9.0, step=5, digest="d"),
        ev.Reopened(run_id=RUN, life=1, step=2, at=6.0),  # the marker again: the first counts
    ]  # fmt: skip
    assert life_events(e, 0) == e[:3]
    assert life_events(e, 1) == e[4:]
    assert life_events(e[:5], 1) == e[4:5]  # a live second life: its end is on its way
    assert life_events(e, 2) == []
    assert whole(e, 0) and whole(e, 1) and not whole(e, 2)
    assert not whole(e[1:], 0) and not whole(e[4:6], 1)  # their beginnings dropped


def test_a_history_without_markers_is_split_at_each_lifes_end() -> None:
    """A reopening an older Baton wrote (no `reopened` event)."""
    e = [
        ev.Accepted(run_id=RUN, at=1.0, name="n", pool="p", total_steps=5),
        ev.Failed(run_id=RUN, reason="boom", at=5.0),
        ev.Resumed(run_id=RUN, reason="back", at=6.0),
        ev.Completed(run_id=RUN, at=9.0, step=5, digest="d"),
    ]  # fmt: skip
    assert life_events(e, 1) == e[2:]
    assert life_events(e[:3], 1) == e[2:3]
    assert life_events(e, 2) == []
    assert whole(e, 1) and not whole(e[:1], 1)


def _history(*entries: Hold | Settle | TopUp) -> History:
    posted = [Posted(seq=i + 1, subject=book.subject_of(x), entry=x) for i, x in enumerate(entries)]
    return History(ledger=posted)


def test_verify_checks_each_life_apart() -> None:
    top = TopUp(owner="alice", id="t", amount=100)
    lives = _history(
        top, Hold(owner="alice", run_id=RUN, n=0, amount=10),
        Settle(owner="alice", run_id=RUN, held=10, charged=4),
        Hold(owner="alice", run_id=RUN, n=0, amount=7, life=1),
        Settle(owner="alice", run_id=RUN, held=7, charged=7, life=1),
    )  # fmt: skip
    assert ledger_sums(lives) == settled_once(lives) == nothing_after_settle(lives) == []
    late = _history(
        top, Hold(owner="alice", run_id=RUN, n=0, amount=10),
        Settle(owner="alice", run_id=RUN, held=10, charged=4),
        Hold(owner="alice", run_id=RUN, n=1, amount=3),
    )  # fmt: skip
    (found,) = nothing_after_settle(late)
    assert "written after its settlement" in found.detail, found
