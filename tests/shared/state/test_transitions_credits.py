"""The credits' transitions, without NATS: a resume takes in a hold only while the run is
PAUSED and unsettled, in the life the hold names; a rollback reopens a settled FAILED run
only as a new life, with that life's first hold (docs/scheduling.md, "Credits")."""

from __future__ import annotations

import msgspec

from shared.contracts import RunState
from shared.state import transitions as t
from tests.shared.state.test_transitions import applied, changed, record, refused, terminal

PRICE = {"cpu": 0.01}


def test_a_resume_takes_in_its_hold_only_while_paused_unsettled_and_in_its_life() -> None:
    paused = record(run_id="alice.r1", price=PRICE, holds=[100], state=RunState.PAUSED)
    new = applied(t.resume(t.Taken(0, 1, 30)), paused)
    assert new.state is RunState.QUEUED and new.holds == [100, 30], new
    assert applied(t.resume(None), paused).holds == [100]  # covered: nothing more held
    refused(t.resume(t.Taken(0, 1, 30)), new)  # a resume again: QUEUED, nothing taken in
    refused(t.resume(t.Taken(0, 2, 30)), paused)  # not the next hold
    refused(t.resume(t.Taken(1, 1, 30)), paused)  # another life's
    refused(t.resume(None), record(state=RunState.PAUSED, settled=True))
    refused(t.resume(t.Taken(0, 1, 30)), *terminal(holds=[100]))


def test_a_settled_failed_run_is_reopened_as_its_next_life_with_that_lifes_hold() -> None:
    failed = record(
        run_id="alice.r1", price=PRICE, holds=[100, 30], metered_s=40.0, state=RunState.FAILED,
        settled=True, reason="boom", worker=None, group=[], delivery=None,
    )  # fmt: skip
    new = applied(t.order_rollback(20, "back", t.Taken(1, 0, 70)), failed)
    assert changed(failed, new) == {
        "state": RunState.QUEUED, "dispatch": 2, "reason": None, "rollback_to": 20,
        "rollback_reason": "back", "admitted": False, "life": 1, "holds": [70],
        "settled": False, "metered_before": 40.0,
    }, changed(failed, new)  # fmt: skip
    assert new.life_metered_s == 0.0 and new.held == 70, new
    # Its second life meters and holds apart from the first.
    later = applied(t.add_hold(t.Taken(1, 1, 5)), new)
    assert later.holds == [70, 5] and later.life == 1, later
    # Not without the next life's first hold, nor before the first life is settled.
    refused(t.order_rollback(20, "back"), failed)
    refused(t.order_rollback(20, "back", t.Taken(2, 0, 70)), failed)
    refused(t.order_rollback(20, "back", t.Taken(1, 1, 70)), failed)
    unsettled = record(run_id="alice.r1", price=PRICE, state=RunState.FAILED, holds=[100])
    refused(t.order_rollback(20, "back", t.Taken(1, 0, 70)), unsettled)
    # A run without a price is reopened as before: one life, nothing held.
    free = record(state=RunState.FAILED)
    assert applied(t.order_rollback(20, "back"), free).life == 0


def test_a_reopened_life_is_settled_on_its_own() -> None:
    done = record(run_id="alice.r1", price=PRICE, holds=[70], life=1, state=RunState.COMPLETED)
    assert applied(t.settled, done).settled
    refused(t.settled, applied(t.settled, done))


def test_an_attempt_that_dies_is_metered_what_it_committed_when_the_next_one_starts() -> None:
    """A commit books the seconds its attempt trained up to it; a verdict books the whole
    attempt instead; an attempt that died without a verdict keeps its committed seconds,
    which the next attempt's start books (the meter's figure counts them either way)."""
    running = record(run_id="alice.r1", price=PRICE, holds=[100], token=3, metered_s=5.0)
    committed = applied(t.advance_step(3, 40, 12.0), running)
    assert committed.committed_s == 12.0 and committed.life_metered_s == 17.0, committed
    later = applied(t.advance_step(3, 80, 20.0), committed)
    assert later.committed_s == 20.0 and later.metered_s == 5.0, later
    refused(t.advance_step(2, 120, 30.0), later)  # a fenced attempt's commit books nothing
    # Its host dies; the next attempt starts under token 4: the 20 s are booked.
    queued = msgspec.structs.replace(later, state=RunState.QUEUED, worker=None, admitted=True)
    again = applied(t.mark_running("t2", 4, None, []), queued)
    assert again.metered_s == 25.0 and again.committed_s == 0.0, again
    assert again.life_metered_s == 25.0, again
    # A verdict books the whole attempt (its commits' seconds among them), once.
    more = applied(t.advance_step(4, 120, 8.0), again)
    booked = applied(t.release(t.Spent(4, 10.0, 0.0, 9.0)), more)
    assert booked.metered_s == 34.0 and booked.committed_s == 0.0, booked


def test_a_reopened_life_begins_after_what_a_dead_attempt_committed() -> None:
    failed = record(
        run_id="alice.r1", price=PRICE, holds=[100], metered_s=40.0, committed_s=6.0,
        state=RunState.FAILED, settled=True, reason="boom", worker=None, group=[],
        delivery=None,
    )  # fmt: skip
    assert failed.life_metered_s == 46.0
    new = applied(t.order_rollback(20, "back", t.Taken(1, 0, 70)), failed)
    assert new.metered_s == 46.0 and new.metered_before == 46.0 and new.committed_s == 0.0
    assert new.life_metered_s == 0.0, new


def test_an_overdraft_pauses_only_runs_that_hold_nothing() -> None:
    """`pause_unheld`: a priced, owned run with no hold (a site's submission) that trains
    or waits is paused — at once when the hub holds it queued, asked where it trains —
    and no other run is."""
    why = "budget: past the overdraft"
    running = record(run_id="bob.r1", price=PRICE, site="lab1", epoch=7)
    asked = applied(t.pause_unheld(why), running)
    assert changed(running, asked) == {"pause_requested": why}, changed(running, asked)
    queued = record(run_id="bob.r2", price=PRICE, state=RunState.QUEUED,
                    worker=None)  # fmt: skip
    assert applied(t.pause_unheld(why), queued).state is RunState.PAUSED
    refused(
        t.pause_unheld(why),
        record(run_id="bob.r3", price=PRICE, holds=[100]),  # it holds
        record(run_id="r4", price=PRICE),  # an operator's
        record(run_id="bob.r5"),  # unpriced
        asked,  # asked already
        record(run_id="bob.r6", price=PRICE, cancel_requested="no"),
        record(run_id="bob.r7", price=PRICE, state=RunState.PAUSED),
        *terminal(price=PRICE),
    )
