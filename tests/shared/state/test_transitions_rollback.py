"""The run record's rollback transitions, without NATS: the order the dispatcher writes, and
the attempt's record of the rollback done (or refused)."""

from __future__ import annotations

from shared.contracts import RunState, Skip
from shared.contracts.records import MAX_REWINDS, Rewind
from shared.state import transitions as t
from tests.shared.state.test_transitions import applied, changed, record, refused

DONE = Rewind(token=5, from_step=10, to_step=4, abandoned=[10, 8, 6], reason="bad data")


def test_an_order_is_written_for_a_queued_running_or_paused_run() -> None:
    for state in (RunState.QUEUED, RunState.RUNNING, RunState.PAUSED):
        r = record(state=state)
        new = applied(t.order_rollback(4, "bad data"), r)
        assert changed(r, new) == {"rollback_to": 4, "rollback_reason": "bad data"}, new
    # A second order replaces the first (the attempt that goes back reads the newest).
    again = applied(t.order_rollback(2, "older"), record(rollback_to=4, rollback_reason="x"))
    assert (again.rollback_to, again.rollback_reason) == (2, "older"), again


def test_a_failed_run_is_reopened_and_a_finished_one_is_not() -> None:
    failed = record(
        state=RunState.FAILED, reason="boom", retries=3, worker=None, group=[], dispatch=2
    )
    new = applied(t.order_rollback(4, "try again"), failed)
    assert changed(failed, new) == {
        "state": RunState.QUEUED, "dispatch": 3, "retries": 0, "reason": None,
        "delivery": None, "rollback_to": 4, "rollback_reason": "try again", "admitted": False,
    }, changed(failed, new)  # fmt: skip
    refused(
        t.order_rollback(4, "x"),
        record(state=RunState.COMPLETED),
        record(state=RunState.CANCELLED),
        record(state=RunState.FAILED, announce_pending=True),  # its failure not told yet
    )


def test_the_attempt_that_rewound_records_it_and_clears_the_order() -> None:
    r = record(rollback_to=4, rollback_reason="bad data")
    new = applied(t.rewound(5, DONE), r)
    assert changed(r, new) == {
        "step": 4, "rewinds": [DONE], "rollback_to": None, "rollback_reason": None,
    }, changed(r, new)  # fmt: skip
    # Another rollback asked meanwhile stays for the next attempt.
    later = record(rollback_to=2, rollback_reason="older")
    assert changed(later, applied(t.rewound(5, DONE), later)) == {"step": 4, "rewinds": [DONE]}
    # The guard's data left out after a checkpoint the rollback abandons is forgotten.
    kept, dropped = Skip(after=4, batches=2), Skip(after=8, batches=3)
    skipped = record(rollback_to=4, skips=[kept, dropped])
    assert applied(t.rewound(5, DONE), skipped).skips == [kept]
    full = record(rewinds=[DONE] * MAX_REWINDS)
    assert len(applied(t.rewound(5, DONE), full).rewinds) == MAX_REWINDS
    refused(t.rewound(5, DONE), record(token=6), record(state=RunState.FAILED))


def test_a_refused_rollback_drops_its_order_only() -> None:
    r = record(rollback_to=4, rollback_reason="bad data")
    new = applied(t.drop_rollback(5, 4), r)
    assert changed(r, new) == {"rollback_to": None, "rollback_reason": None}, changed(r, new)
    refused(
        t.drop_rollback(5, 4),
        record(rollback_to=2),
        record(rollback_to=4, token=6),
        record(rollback_to=4, state=RunState.CANCELLED),
    )
