"""The run record's named transitions, without NATS: each one applied (the fields it sets,
and nothing else), and each condition under which it refuses (returns None)."""

from __future__ import annotations

import msgspec
import pytest

from shared.contracts import JobSpec, RunRecord, RunState, Skip, convert, spec_hash
from shared.contracts.records import Preemption, Stall
from shared.state import transitions as t
from shared.state.runs import Change

SPEC = convert(
    {"name": "t", "entry_point": "m:f", "total_steps": 5, "limits": {"max_retries": 2}}, JobSpec
)
TERMINAL = [RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED]


def record(**fields: object) -> RunRecord:
    base = RunRecord(
        run_id="r1", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=1.0, updated_at=1.0,
        state=RunState.RUNNING, worker="w1", token=5, delivery="$JS.ACK.d1", step=10,
        busy_s=3.0, actual_cost=0.5, group=["w1", "w2"], group_size=2,
    )  # fmt: skip
    return msgspec.structs.replace(base, **fields)


def applied(change: Change, r: RunRecord) -> RunRecord:
    new = change(r)
    assert new is not None, f"refused {r}"
    return new


def changed(old: RunRecord, new: RunRecord) -> dict[str, object]:
    """The fields that differ, with their new values."""
    a, b = msgspec.structs.asdict(old), msgspec.structs.asdict(new)
    return {k: b[k] for k in a if a[k] != b[k]}


def refused(change: Change, *records: RunRecord) -> None:
    for r in records:
        assert change(r) is None, f"applied to {r}"


def terminal(**fields: object) -> list[RunRecord]:
    return [record(state=s, **fields) for s in TERMINAL]


SPENT = t.Spent(token=5, busy_s=2.0, cost=0.25)


# -- starting and holding an attempt ----------------------------------------------------


def test_mark_running() -> None:
    r = record(state=RunState.QUEUED, worker=None, token=4, attempts=1, waiting="forming")
    new = applied(t.mark_running("w9", 5, "$JS.ACK.d9", ["w9", "w3"]), r)
    assert changed(r, new) == {
        "state": RunState.RUNNING, "worker": "w9", "token": 5, "attempts": 2,
        "delivery": "$JS.ACK.d9", "waiting": None, "group": ["w9", "w3"],
    }, changed(r, new)  # fmt: skip
    one = applied(t.mark_running("w9", 5, None, []), r)
    assert one.group == [] and one.group_size == 1 and one.delivery is None
    fresh = record(state=RunState.QUEUED, token=None, group=[], group_size=0)
    first = applied(t.mark_running("w9", 1, None, []), fresh)
    assert first.state is RunState.RUNNING and first.token == 1, first
    same = applied(t.mark_running("w9", 5, None, []), record())  # its own token again
    assert same.attempts == 1, same
    refused(t.mark_running("w9", 5, None, []), *terminal(), record(token=6))


def test_advance_step() -> None:
    r = record()
    assert changed(r, applied(t.advance_step(5, 12), r)) == {"step": 12}
    refused(t.advance_step(5, 12), *terminal())
    refused(t.advance_step(5, 12), record(token=4), record(token=6), record(token=None))
    refused(t.advance_step(5, 10), r)  # not ahead of the record
    refused(t.advance_step(5, 9), r)


def test_retoken() -> None:
    r = record()
    assert changed(r, applied(t.retoken(5, 8), r)) == {"token": 8}
    refused(t.retoken(5, 8), *terminal(), record(token=6), record(token=4), record(token=None))


def test_wait() -> None:
    r = record(state=RunState.QUEUED, token=5)
    assert changed(r, applied(t.wait("forming", 5), r)) == {"waiting": "forming"}
    assert applied(t.wait("forming", 5), record(token=None)).waiting == "forming"
    assert applied(t.wait("forming", 5), record(token=3)).waiting == "forming"
    again = record(waiting="forming")
    assert applied(t.wait("forming", 5), again) == again  # written even when unchanged
    refused(t.wait("forming", 5), *terminal(), record(token=6))


def test_note_waiting() -> None:
    r = record(state=RunState.QUEUED, token=5)
    assert changed(r, applied(t.note_waiting("forming", 5), r)) == {"waiting": "forming"}
    assert applied(t.note_waiting("forming", 5), record(token=None)).waiting == "forming"
    refused(t.note_waiting("forming", 5), *terminal(), record(token=6))
    refused(t.note_waiting("forming", 5), record(waiting="forming"))  # says it already


# -- an attempt's verdict ---------------------------------------------------------------


def test_book_time() -> None:
    r = record()
    assert changed(r, applied(t.book_time(SPENT), r)) == {"busy_s": 5.0, "actual_cost": 0.75}
    new = applied(t.book_time(SPENT, step=12), r)
    assert changed(r, new) == {"busy_s": 5.0, "actual_cost": 0.75, "step": 12}
    # Nobody holds the run: no group trains it either.
    new = applied(t.book_time(SPENT, worker=None), r)
    assert new.worker is None and new.group == [], new
    refused(t.book_time(SPENT), *terminal(), record(token=6), record(token=4))


def test_complete() -> None:
    r = record(reason="old")
    new = applied(t.complete(SPENT, 20, "d" * 64, {"loss": 0.1}), r)
    assert changed(r, new) == {
        "state": RunState.COMPLETED, "step": 20, "digest": "d" * 64, "metrics": {"loss": 0.1},
        "worker": None, "reason": None, "group": [], "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip
    refused(t.complete(SPENT, 20, "d", {}), *terminal(), record(token=6))


def test_cancel_attempt() -> None:
    r = record()
    new = applied(t.cancel_attempt(SPENT, "asked"), r)
    assert changed(r, new) == {
        "state": RunState.CANCELLED, "reason": "asked", "worker": None, "group": [],
        "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip
    assert applied(t.cancel_attempt(SPENT, "asked", 14), r).step == 14
    refused(t.cancel_attempt(SPENT, "asked"), *terminal(), record(token=6))


def test_release() -> None:
    r = record()
    new = applied(t.release(SPENT), r)
    booked: dict[str, object] = {"worker": None, "group": [], "busy_s": 5.0, "actual_cost": 0.75}
    assert changed(r, new) == booked, changed(r, new)
    assert new.state is RunState.RUNNING and new.token == 5, new
    assert applied(t.release(SPENT, 14), r).step == 14
    refused(t.release(SPENT), *terminal(), record(token=6))


def test_count_failure_retries_while_retries_are_left() -> None:
    r = record(retries=1, stop_token=5, stop_reason="stalled")
    new = applied(t.count_failure(lambda: 5, SPENT, "boom", fatal=False), r)
    assert changed(r, new) == {
        "retries": 2, "stop_token": None, "stop_reason": None, "worker": None, "group": [],
        "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip


def test_count_failure_fails_the_run() -> None:
    used_up = record(retries=2, reason="old")
    new = applied(t.count_failure(lambda: 5, SPENT, "boom", fatal=False), used_up)
    assert new.state is RunState.FAILED and new.reason == "boom" and new.retries == 3, new
    fatal = applied(t.count_failure(lambda: 5, SPENT, "no module", fatal=True), record())
    assert fatal.state is RunState.FAILED and fatal.reason == "no module", fatal
    assert fatal.retries == 1, fatal


def test_a_checkpoint_asked_is_counted_in_the_record_while_it_trains() -> None:
    running = record(state=RunState.RUNNING)
    assert applied(t.ask_checkpoint, applied(t.ask_checkpoint, running)).checkpoints_asked == 2
    assert t.ask_checkpoint(record(state=RunState.QUEUED)) is None
    assert t.ask_checkpoint(record(state=RunState.COMPLETED)) is None


def test_a_hang_after_the_same_step_again_is_not_retried() -> None:
    """The stall is recorded; one after another step is retried as any failure, one after
    the same step again fails the run (or pauses it, where the job pauses on a failure)."""
    hung = Stall(step=150, step_s=0.01)
    first = applied(t.count_failure(lambda: 5, SPENT, "stalled", fatal=False, stall=hung), record())
    assert first.state is RunState.RUNNING and first.stall == Stall(step=150, step_s=0.01)
    elsewhere = t.count_failure(lambda: 5, SPENT, "stalled", fatal=False, stall=Stall(step=151))
    assert applied(elsewhere, first).state is RunState.RUNNING
    again = t.count_failure(lambda: 5, SPENT, "stalled", fatal=False, stall=Stall(step=150))
    failed = applied(again, first)
    assert failed.state is RunState.FAILED and failed.retries == 2, failed
    assert failed.reason == (
        "stalled, as the attempt before did: a hang that repeats is not retried"
    ), failed.reason
    paused = applied(again, msgspec.structs.replace(first, on_failure="pause"))
    assert paused.state is RunState.PAUSED and "repeats" in (paused.pause_requested or "")
    crashed = applied(t.count_failure(lambda: 5, SPENT, "boom", fatal=False), first)
    assert crashed.stall == first.stall, "another failure keeps what the last stall was"


def test_count_failure_reads_the_token_as_it_applies() -> None:
    holding = [5]
    change = t.count_failure(lambda: holding[0], SPENT, "boom", fatal=False)
    refused(change, *terminal(), record(token=6), record(token=4))
    holding[0] = 6  # re-taken under a new token after the verdict was decided
    refused(change, record())
    # The record names the new token: the failure counts, the old token's time does not.
    new = applied(change, record(token=6))
    assert new.retries == 1 and new.busy_s == 3.0 and new.actual_cost == 0.5, new


def test_cancel_unowned() -> None:
    r = record(cancel_requested="asked")
    new = applied(t.cancel_unowned, r)
    assert changed(r, new) == {"state": RunState.CANCELLED, "reason": "asked"}
    refused(t.cancel_unowned, record(), record(state=RunState.QUEUED, cancel_requested="x"))
    refused(t.cancel_unowned, *terminal(cancel_requested="asked"))


def test_unchanged() -> None:
    refused(t.unchanged, record(), record(state=RunState.QUEUED), *terminal())


# -- ending, cancelling, stopping -------------------------------------------------------


def test_fail() -> None:
    for r in (record(), record(state=RunState.QUEUED, worker=None)):
        new = applied(t.fail("refused"), r)
        assert new.state is RunState.FAILED and new.reason == "refused", new
        assert new.worker is None, new
    failed = {"state": RunState.FAILED, "reason": "x", "worker": None}
    assert changed(record(), applied(t.fail("x"), record())) == failed
    refused(t.fail("refused"), *terminal())


def test_end() -> None:
    r = record()
    new = applied(t.end(RunState.FAILED, "hard_timeout"), r)
    assert changed(r, new) == {"state": RunState.FAILED, "reason": "hard_timeout"}  # worker kept
    queued = record(state=RunState.QUEUED)
    assert applied(t.end(RunState.CANCELLED, "asked"), queued).state is RunState.CANCELLED
    refused(t.end(RunState.FAILED, "hard_timeout"), *terminal())


def test_cancel() -> None:
    queued = record(state=RunState.QUEUED, worker=None)
    new = applied(t.cancel("asked"), queued)
    assert changed(queued, new) == {"state": RunState.CANCELLED, "reason": "asked"}
    running = record()
    assert changed(running, applied(t.cancel("asked"), running)) == {"cancel_requested": "asked"}
    refused(t.cancel("again"), record(cancel_requested="asked"), *terminal())


def test_a_paused_run_is_cancelled_wherever_it_was_granted() -> None:
    """Nothing trains a PAUSED run, and only the hub resumes one: cancelled at once, one a
    site paused the hub's again under the next epoch — also when a cancel was asked of it
    while it ran there (the site paused it first)."""
    at_site = record(state=RunState.PAUSED, site="lab1", epoch=3, worker=None, group=[])
    new = applied(t.cancel("asked"), at_site)
    assert changed(at_site, new) == {
        "state": RunState.CANCELLED, "reason": "asked", "site": "", "epoch": 4,
        "delivery": None,
    }, changed(at_site, new)  # fmt: skip
    asked = msgspec.structs.replace(at_site, cancel_requested="earlier")
    assert applied(t.cancel("again"), asked).reason == "again"
    assert applied(t.cancel_untrained, asked).reason == "earlier"
    refused(t.resume(), asked)  # asked to cancel: not resumed


def test_cancel_untrained_ends_only_what_nothing_trains() -> None:
    queued = record(state=RunState.QUEUED, worker=None, cancel_requested="asked")
    assert applied(t.cancel_untrained, queued).state is RunState.CANCELLED
    refused(
        t.cancel_untrained,
        record(cancel_requested="asked"),  # RUNNING: its trainer ends it
        record(state=RunState.QUEUED, site="lab1", cancel_requested="asked"),  # the site's
        record(state=RunState.QUEUED, worker=None),  # not asked
        *terminal(cancel_requested="asked"),
    )


def test_warn() -> None:
    r = record(warned=["stalled"])
    new = applied(t.warn("soft_timeout"), r)
    assert changed(r, new) == {"warned": ["stalled", "soft_timeout"]}
    queued = applied(t.warn("soft_timeout"), record(state=RunState.QUEUED))
    assert queued.warned == ["soft_timeout"], queued
    refused(t.warn("stalled"), r)
    refused(t.warn("soft_timeout"), *terminal())


def test_redispatch() -> None:
    r = record(dispatch=2)
    assert changed(r, applied(t.redispatch(2), r)) == {"dispatch": 3, "worker": None}
    refused(t.redispatch(2), record(dispatch=3), record(dispatch=2, state=RunState.QUEUED))
    refused(t.redispatch(2), *terminal(dispatch=2))


def test_hand_over() -> None:
    r = record()
    assert changed(r, applied(t.hand_over(5), r)) == {"delivery": None}
    refused(t.hand_over(5), record(token=6), record(worker=None), record(delivery=None))
    refused(t.hand_over(5), record(delivery=""), record(state=RunState.QUEUED), *terminal())


# -- announcing an ending ---------------------------------------------------------------


def test_mark_ending_marks_only_an_ending() -> None:
    r = record()
    ending = applied(t.mark_ending(t.fail("x"), "site-a"), r)
    assert ending.announce_pending and ending.ending_site == "site-a", ending
    assert changed(r, ending) == {
        "state": RunState.FAILED, "reason": "x", "worker": None, "announce_pending": True,
        "ending_site": "site-a",
    }, changed(r, ending)  # fmt: skip
    going_on = applied(t.mark_ending(t.retoken(5, 8), "site-a"), r)
    assert changed(r, going_on) == {"token": 8}
    refused(t.mark_ending(t.fail("x"), ""), *terminal())


def test_announced() -> None:
    r = record(state=RunState.FAILED, announce_pending=True, ending_site="s")
    assert changed(r, applied(t.announced, r)) == {"announce_pending": False}
    refused(t.announced, record(), *terminal())


@pytest.mark.parametrize(
    "change",
    [
        t.mark_running("w", 9, None, []), t.advance_step(5, 99), t.retoken(5, 9),
        t.wait("x", 9), t.note_waiting("x", 9), t.book_time(SPENT),
        t.complete(SPENT, 1, "d", {}), t.cancel_attempt(SPENT, "x"), t.release(SPENT),
        t.count_failure(lambda: 5, SPENT, "x", fatal=True), t.cancel_unowned, t.unchanged,
        t.fail("x"), t.end(RunState.FAILED, "x"), t.cancel("x"), t.pause("x"), t.warn("x"),
        t.redispatch(1), t.hand_over(5), t.mark_ending(t.fail("x"), "s"), t.resume(),
        t.pause_attempt(SPENT, "x"), t.pause_unowned, t.roll_back(SPENT, Skip(after=1, batches=1)),
    ],
)  # fmt: skip
def test_no_transition_but_announced_changes_a_terminal_record(change: Change) -> None:
    refused(change, *terminal(cancel_requested="x", pause_requested="x", stop_token=5))


# -- failure policies, pausing, the guard's rollback ------------------------------------


def test_count_failure_fails_fast() -> None:
    r = record(on_failure="fail_fast")
    new = applied(t.count_failure(lambda: 5, SPENT, "boom", fatal=False), r)
    assert new.state is RunState.FAILED and new.reason == "boom" and new.retries == 1, new


def test_count_failure_pauses_for_a_human() -> None:
    r = record(on_failure="pause", retries=2)  # even with the retries used up
    new = applied(t.count_failure(lambda: 5, SPENT, "boom", fatal=False), r)
    assert new.state is RunState.PAUSED and new.worker is None and new.reason is None, new
    assert new.pause_requested == "held for a human after: boom", new
    # An entry point that cannot be loaded fails, whatever the policy.
    fatal = applied(t.count_failure(lambda: 5, SPENT, "no module", fatal=True), r)
    assert fatal.state is RunState.FAILED, fatal


def test_pause() -> None:
    queued = record(state=RunState.QUEUED, worker=None)
    new = applied(t.pause("look"), queued)
    assert changed(queued, new) == {"state": RunState.PAUSED, "pause_requested": "look"}
    running = record()
    assert changed(running, applied(t.pause("look"), running)) == {"pause_requested": "look"}
    refused(t.pause("again"), record(pause_requested="look"), record(state=RunState.PAUSED))
    refused(t.pause("x"), *terminal())


def test_pause_attempt() -> None:
    r = record(pause_requested="look")
    new = applied(t.pause_attempt(SPENT, "look", step=12), r)
    assert changed(r, new) == {
        "state": RunState.PAUSED, "worker": None, "group": [], "step": 12,
        "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip
    refused(t.pause_attempt(SPENT, "look"), record(token=6), *terminal())


def test_pause_unowned() -> None:
    r = record(pause_requested="look")
    new = applied(t.pause_unowned, r)
    assert changed(r, new) == {"state": RunState.PAUSED, "worker": None, "group": []}
    refused(t.pause_unowned, record(), *terminal(pause_requested="look"))


def test_resume() -> None:
    r = record(state=RunState.PAUSED, pause_requested="look", worker=None, retries=3, dispatch=2)
    new = applied(t.resume(), r)
    assert changed(r, new) == {
        "state": RunState.QUEUED, "dispatch": 3, "pause_requested": None, "retries": 0,
        "group": [], "admitted": False,
    }, changed(r, new)  # fmt: skip
    refused(t.resume(), record(), record(state=RunState.QUEUED), *terminal())


def test_a_run_paused_at_a_site_resumes_as_the_hubs_under_the_next_epoch() -> None:
    """Its grant was spent (the site's record stays PAUSED; a grant goes out once per
    epoch): the scheduler decides afresh, and a new grant is the next epoch's."""
    r = record(state=RunState.PAUSED, site="lab1", epoch=4, worker=None, admitted=True)
    new = applied(t.resume(), r)
    assert (new.state, new.site, new.epoch, new.admitted) == (RunState.QUEUED, "", 5, False)
    regranted = applied(t.delegate("lab1"), new)
    assert (regranted.site, regranted.epoch) == ("lab1", 6), regranted


def test_a_paused_run_is_not_marked_running_nor_redispatched() -> None:
    paused = record(state=RunState.PAUSED, worker=None)
    refused(t.mark_running("w9", 9, None, []), paused)
    refused(t.redispatch(1), paused)
    cancelled = applied(t.cancel("stop"), paused)
    assert cancelled.state is RunState.CANCELLED, cancelled


def test_roll_back() -> None:
    first = Skip(after=10, batches=4)
    r = record(skips=[first])
    new = applied(t.roll_back(SPENT, Skip(after=20, batches=3)), r)
    assert changed(r, new) == {
        "worker": None, "group": [], "skips": [first, Skip(after=20, batches=3)],
        "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip
    refused(t.roll_back(SPENT, first), record(token=6), *terminal())


# -- the scheduler -----------------------------------------------------------------------

PRIORITY = Preemption(by="r2", kind="priority", reason="priority 10 over 0")


def test_admit() -> None:
    r = record(state=RunState.QUEUED, worker=None, admitted=False, dispatch=3)
    new = applied(t.admit(3, None), r)
    assert changed(r, new) == {"admitted": True}, changed(r, new)
    assert applied(t.admit(3, 2), r).ranks_cap == 2
    refused(
        t.admit(3, None), new, record(admitted=False), *terminal(admitted=False),
        record(state=RunState.QUEUED, admitted=False, dispatch=4),
        record(state=RunState.QUEUED, admitted=False, dispatch=3, site="lab1"),
        record(state=RunState.QUEUED, admitted=False, dispatch=3, pause_requested="p"),
    )  # fmt: skip


def test_a_run_waiting_for_the_scheduler_is_not_marked_running() -> None:
    waiting = record(state=RunState.QUEUED, worker=None, admitted=False)
    refused(t.mark_running("w9", 6, None, []), waiting)
    shrunk = record(preempt=Preemption(by="r2", kind="priority", reason="", to_ranks=1))
    assert applied(t.mark_running("w9", 6, None, []), shrunk).preempt is None


def test_ask_preempt() -> None:
    r = record()
    new = applied(t.ask_preempt(5, PRIORITY), r)
    assert changed(r, new) == {"preempt": PRIORITY}, changed(r, new)
    shrink = Preemption(by="r2", kind="priority", reason="", to_ranks=1)
    assert applied(t.ask_preempt(5, shrink), r).ranks_cap == 1
    refused(
        t.ask_preempt(5, PRIORITY), new, record(token=6), *terminal(),
        record(state=RunState.QUEUED), record(site="lab1"), record(pause_requested="p"),
        record(cancel_requested="c"),
    )  # fmt: skip


def test_requeue() -> None:
    r = record(preempt=PRIORITY, ranks_cap=2, dispatch=4)
    new = applied(t.requeue(SPENT, 20), r)
    assert changed(r, new) == {
        "state": RunState.QUEUED, "admitted": False, "preempt": None, "ranks_cap": None,
        "worker": None, "group": [], "delivery": None, "dispatch": 5, "preemptions": 1,
        "step": 20, "busy_s": 5.0, "actual_cost": 0.75,
    }, changed(r, new)  # fmt: skip
    refused(t.requeue(SPENT), record(token=6), *terminal())


def test_requeue_unowned() -> None:
    r = record(preempt=PRIORITY, worker=None)
    new = applied(t.requeue_unowned, r)
    assert new.state is RunState.QUEUED and not new.admitted and new.dispatch == 2, new
    shrink = Preemption(by="r2", kind="priority", reason="", to_ranks=1)
    refused(t.requeue_unowned, record(), record(preempt=shrink), *terminal(preempt=PRIORITY))


def test_cap_ranks() -> None:
    r = record(ranks_cap=1)
    assert changed(r, applied(t.cap_ranks(3), r)) == {"ranks_cap": 3}
    refused(t.cap_ranks(3), record(ranks_cap=3), record(preempt=PRIORITY), *terminal())


def test_add_hold_and_settled() -> None:
    r = record(holds=[100])
    assert changed(r, applied(t.add_hold(t.Taken(0, 1, 50)), r)) == {"holds": [100, 50]}
    refused(t.add_hold(t.Taken(0, 0, 50)), r)  # the first hold is there already
    refused(t.add_hold(t.Taken(1, 1, 50)), r)  # a hold of another life
    refused(t.add_hold(t.Taken(0, 1, 50)), *terminal(holds=[100]))
    done = record(state=RunState.COMPLETED)
    assert applied(t.settled, done).settled
    refused(t.settled, record(), record(state=RunState.COMPLETED, settled=True))


def test_a_resumed_taken_back_or_reopened_run_waits_for_the_scheduler() -> None:
    assert not applied(t.resume(), record(state=RunState.PAUSED)).admitted
    granted = record(state=RunState.QUEUED, site="lab1", epoch=1)
    assert not applied(t.take_back("lab1", 1), granted).admitted
    failed = record(state=RunState.FAILED)
    assert not applied(t.order_rollback(5, "back"), failed).admitted
    queued = record(state=RunState.QUEUED, worker=None, group=[], admitted=False)
    assert applied(t.delegate("lab1"), queued).admitted
    refused(t.delegate("lab1"), record(state=RunState.QUEUED, worker=None))  # admitted
