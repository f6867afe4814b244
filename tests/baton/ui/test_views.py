"""A run page's ending, computed without a server: none while the run lives; once its record
is terminal, its state, step and reason, with its terminal event's time on the hub's clock
when that event is stored."""

from __future__ import annotations

import msgspec
import pytest

from baton.ui.views import run_view
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Accepted, Cancelled, Completed, Event, Failed, Started

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 5}, JobSpec)
HUB0 = 1_800_000_000.0
SKEW = 300.0
HISTORY: list[Event] = [
    Accepted(run_id="r1", at=HUB0, name="t", pool="default", total_steps=5),
    Started(run_id="r1", at=HUB0 + 1 + SKEW, worker="t1", token=1, attempt=1, start_step=0),
]
STAMPS = [HUB0, HUB0 + 1.0]


def record(state: RunState, step: int = 0, reason: str | None = None) -> RunRecord:
    return RunRecord(
        run_id="r1", spec=SPEC, spec_hash=spec_hash(SPEC), created_at=HUB0, updated_at=HUB0,
        state=state, step=step, reason=reason,
    )  # fmt: skip


def test_a_live_run_has_no_ending() -> None:
    for state in (RunState.QUEUED, RunState.RUNNING):
        assert run_view(record(state), HISTORY, STAMPS, 2, HUB0 + 9)["ending"] is None


def test_a_completed_run_ends_at_its_completed_event_on_the_hubs_clock() -> None:
    done = Completed(run_id="r1", at=HUB0 + 11 + SKEW, step=5, digest="d")
    view = run_view(
        record(RunState.COMPLETED, 5), [*HISTORY, done], [*STAMPS, HUB0 + 11.0], 3, HUB0 + 20
    )
    assert view["ending"] == {
        "kind": "completed", "state": "COMPLETED", "reason": "", "detail": "", "step": 5,
        "at": pytest.approx(HUB0 + 11.0),
    }  # fmt: skip


def test_a_failed_or_cancelled_run_says_why() -> None:
    failed = Failed(run_id="r1", at=HUB0 + 5 + SKEW, reason="user code failed", detail="Trace")
    view = run_view(
        record(RunState.FAILED, 2, "user code failed"), [*HISTORY, failed],
        [*STAMPS, HUB0 + 5.0], 3, HUB0 + 9,
    )  # fmt: skip
    ending = view["ending"]
    assert (ending["kind"], ending["reason"], ending["detail"]) == (
        "failed", "user code failed", "Trace",
    )  # fmt: skip
    assert ending["at"] == pytest.approx(HUB0 + 5.0)

    stopped = Cancelled(run_id="r1", at=HUB0 + 3, reason="cancelled by alice")
    view = run_view(
        record(RunState.CANCELLED, 0, "cancelled by alice"), [*HISTORY, stopped],
        [*STAMPS, HUB0 + 3.0], 3, HUB0 + 9,
    )  # fmt: skip
    assert (view["ending"]["kind"], view["ending"]["reason"]) == ("cancelled", "cancelled by alice")


def test_an_ending_whose_event_is_not_stored_is_the_records() -> None:
    """A run whose terminal event is gone (or not yet out): what its record says, no time."""
    ended = record(RunState.FAILED, 3, "deadline passed")
    ending = run_view(ended, HISTORY, STAMPS, 2, HUB0 + 9)["ending"]
    assert ending == {
        "kind": "failed", "state": "FAILED", "reason": "deadline passed", "detail": "",
        "step": 3, "at": None,
    }  # fmt: skip
    # A terminal event of another kind than the record's is not its ending.
    done = Completed(run_id="r1", at=HUB0 + 4, step=3, digest="d")
    other = run_view(ended, [*HISTORY, done], [*STAMPS, HUB0 + 4.0], 3, HUB0 + 9)
    assert other["ending"] == ending
    assert msgspec.json.decode(msgspec.json.encode(other)) == other  # JSON as sent
