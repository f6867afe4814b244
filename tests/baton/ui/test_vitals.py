"""What an operator watches on a run's page, computed without a server: why the run is held,
its lineage, its divergence guard's stops and the data left out, its stalls, what a failure
now would lose, and its interruptions by cause — every time on the hub's clock, whatever
its trainers' clocks say."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from baton.ui.views import run_view
from baton.ui.vitals import at_risk, hold, stalls, vitals
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import (
    Accepted,
    Event,
    Forked,
    Guarded,
    Paused,
    Preempted,
    Progress,
    Restored,
    RolledBack,
    Round,
    RunWarning,
    StallRecovered,
    Started,
)
from shared.contracts.records import Rewind, Skip
from shared.contracts.rounds import RoundNote

HUB0 = 1_800_000_000.0
SKEW = 300.0
"""The second attempt's trainer runs 5 minutes ahead of the hub."""


def spec(**over: Any) -> JobSpec:
    return convert({"name": "t", "entry_point": "m:f", "total_steps": 50, **over}, JobSpec)


def record(state: RunState, **over: Any) -> RunRecord:
    s = over.pop("spec", spec())
    return RunRecord(
        run_id="r1", spec=s, spec_hash=spec_hash(s), created_at=HUB0, updated_at=HUB0,
        state=state, **over,
    )  # fmt: skip


def progress(at: float, step: int, worker: str, risk: int = 0, age: float = 0.0) -> Progress:
    return Progress(
        run_id="r1", at=at, step=step, total_steps=50, worker=worker, steps_at_risk=risk,
        checkpoint_age_s=age,
    )  # fmt: skip


def two_attempts() -> tuple[list[Event], list[float]]:
    """Attempt 1 (t1, the hub's clock) steps to 12, is preempted at 10 s; attempt 2 (t2, 5
    minutes ahead) starts at 13 s, restores step 10, steps at 15 s: 5 s without progress by
    the hub's clock. The stamps are the hub's receipt, each 0.01 s after."""
    events: list[Event] = [
        Accepted(run_id="r1", at=HUB0, name="t", pool="default", total_steps=50),
        Started(run_id="r1", at=HUB0 + 1, worker="t1", token=1, attempt=1, start_step=0),
        Restored(run_id="r1", at=HUB0 + 2, worker="t1", step=0),
        progress(HUB0 + 9, 11, "t1", risk=1, age=0.5),
        progress(HUB0 + 10, 12, "t1", risk=2, age=1.5),
        Preempted(run_id="r1", at=HUB0 + 10.5, worker="t1", step=10, reason="drain"),
        Started(run_id="r1", at=HUB0 + 13 + SKEW, worker="t2", token=2, attempt=2, start_step=10),
        Restored(run_id="r1", at=HUB0 + 14 + SKEW, worker="t2", step=10),
        progress(HUB0 + 15 + SKEW, 11, "t2", risk=1, age=0.8),
    ]
    ahead = {6, 7, 8}
    stamps = [e.at - (SKEW if i in ahead else 0.0) + 0.01 for i, e in enumerate(events)]
    return events, stamps


def test_interruptions_are_timed_on_the_hubs_clock_and_grouped_by_cause() -> None:
    events, stamps = two_attempts()
    view = run_view(record(RunState.RUNNING, worker="t2", step=10), events, stamps, 9, HUB0 + 20)
    found = view["vitals"]["interruptions"]
    [each] = found["each"]
    assert each["cause"] == "preemption" and (each["from_step"], each["to_step"]) == (12, 10)
    # From its last step (10 s) to the next attempt's first (15 s): not 5 minutes more.
    assert each["seconds"] == pytest.approx(5.0, abs=0.05)
    assert found["by_cause"] == [
        {"cause": "preemption", "count": 1, "mean_s": pytest.approx(5.0, abs=0.05)}
    ]
    sent = msgspec.json.decode(msgspec.json.encode(view))  # JSON as sent
    assert sent["vitals"] == view["vitals"]


def test_what_a_failure_now_would_lose_is_the_running_attempts_latest_report() -> None:
    events, stamps = two_attempts()
    view = run_view(record(RunState.RUNNING, worker="t2", step=10), events, stamps, 9, HUB0 + 20)
    risk = view["vitals"]["at_risk"]
    assert (risk["steps"], risk["checkpoint_age_s"], risk["step"], risk["worker"]) == (
        1, 0.8, 11, "t2",
    )  # fmt: skip
    assert risk["at"] == pytest.approx(HUB0 + 15.01)  # on the hub's clock
    # An attempt that has not reported yet has nothing of its own at risk; nor has a run
    # that is not training.
    fresh = events[:8]
    assert at_risk(record(RunState.RUNNING), fresh) is None
    for state in (RunState.QUEUED, RunState.PAUSED, RunState.COMPLETED):
        assert at_risk(record(state), events) is None


def test_a_paused_run_says_why_and_a_pausing_one_that_it_is_asked() -> None:
    asked = hold(record(RunState.PAUSED, pause_requested="maintenance"), [])
    assert (asked["paused"], asked["pausing"], asked["why"]) == (True, False, "maintenance")
    by_policy = Paused(run_id="r1", at=HUB0, reason="failed under the pause policy", step=4)
    assert hold(record(RunState.PAUSED), [by_policy])["why"] == "failed under the pause policy"
    pausing = hold(record(RunState.RUNNING, pause_requested="swap a disk"), [])
    assert (pausing["paused"], pausing["pausing"], pausing["why"]) == (False, True, "swap a disk")
    ordered = hold(record(RunState.RUNNING, rollback_to=20, rollback_reason="bad shard"), [])
    assert (ordered["rollback_to"], ordered["rollback_reason"]) == (20, "bad shard")
    over = hold(record(RunState.CANCELLED, cancel_requested="stop", rollback_to=20), [])
    assert (over["cancelling"], over["rollback_to"]) == (None, None)


def test_lineage_names_the_parent_its_graft_and_each_rollback_with_its_time() -> None:
    forked = record(
        RunState.RUNNING, spec=spec(fork={"run_id": "rparent", "step": 20}),
        rewinds=[Rewind(token=4, from_step=40, to_step=30, abandoned=[35, 40], reason="bad")],
    )  # fmt: skip
    events: list[Event] = [
        Forked(run_id="r1", at=HUB0 + 1, token=1, parent="rparent", step=20, manifest="m",
               digest="d"),
        RolledBack(run_id="r1", at=HUB0 + 9, token=4, from_step=40, to_step=30,
                   abandoned=[35, 40]),
    ]  # fmt: skip
    found = vitals(forked, events)["lineage"]
    assert found["forked_from"] == {"run_id": "rparent", "step": 20}
    assert found["graft"] == {"token": 1, "digest": "d", "at": HUB0 + 1}
    assert found["rewinds"] == [
        {"token": 4, "from_step": 40, "to_step": 30, "abandoned": [35, 40], "reason": "bad",
         "at": HUB0 + 9},
    ]  # fmt: skip
    plain = vitals(record(RunState.RUNNING), [])["lineage"]
    assert plain == {"forked_from": None, "graft": None, "rewinds": []}


def test_the_guards_stops_and_the_data_left_out() -> None:
    guarded = Guarded(
        run_id="r1", at=HUB0 + 3, worker="t1", step=13, metric="loss", value="inf",
        rule="non_finite", action="rollback", good_step=10,
    )  # fmt: skip
    found = vitals(record(RunState.RUNNING, skips=[Skip(after=10, batches=3)]), [guarded])
    assert found["guard"] == {
        "actions": [{
            "at": HUB0 + 3, "worker": "t1", "step": 13, "metric": "loss", "value": "inf",
            "rule": "non_finite", "action": "rollback", "good_step": 10,
        }],
        "skips": [{"after": 10, "batches": 3}],
    }  # fmt: skip


def test_each_stall_and_whether_it_stepped_again() -> None:
    events: list[Event] = [
        RunWarning(run_id="r1", at=HUB0 + 5, kind="stalled", detail="no step for 40s"),
        RunWarning(run_id="r1", at=HUB0 + 6, kind="soft_timeout", detail="past 1h"),
        StallRecovered(run_id="r1", at=HUB0 + 9, worker="t1", step=7, quiet_s=44.0),
        StallRecovered(run_id="r1", at=HUB0 + 10, worker="t1", step=8, quiet_s=1.0),
        RunWarning(run_id="r1", at=HUB0 + 20, kind="stalled", detail="no step for 60s"),
    ]
    assert stalls(events) == [
        {"at": HUB0 + 5, "detail": "no step for 40s", "recovered_at": HUB0 + 9, "step": 7,
         "quiet_s": 44.0},
        {"at": HUB0 + 20, "detail": "no step for 60s", "recovered_at": None, "step": None,
         "quiet_s": None},
    ]  # fmt: skip


def test_the_page_marks_what_operators_did_and_the_guards_stops() -> None:
    events, stamps = two_attempts()
    extra: list[Event] = [
        Guarded(run_id="r1", at=HUB0 + 16 + SKEW, worker="t2", step=13, metric="loss",
                value="nan", rule="non_finite", action="pause", good_step=10),
        Paused(run_id="r1", at=HUB0 + 17, reason="guard", step=10),
    ]  # fmt: skip
    view = run_view(
        record(RunState.PAUSED, pause_requested="guard"), [*events, *extra],
        [*stamps, HUB0 + 16.01, HUB0 + 17.01], 11, HUB0 + 20,
    )  # fmt: skip
    kinds = [m["kind"] for m in view["marks"]]
    assert kinds[-2:] == ["guarded", "paused"], kinds
    assert view["vitals"]["hold"]["paused"] and view["vitals"]["at_risk"] is None


def test_a_replicas_page_shows_its_rounds_and_boundaries_without_the_store() -> None:
    replica = msgspec.structs.replace(record(RunState.RUNNING), spec=spec(replicas=3, replica=1))
    notes = [
        RoundNote(outcome="joined", replica=1, step=10, base=0, round=1, replicas=[0, 1, 2],
                  closed_by=2, waited_s=0.5, sent_bytes=100, received_bytes=200),
        RoundNote(outcome="skipped", replica=1, step=20, base=1, round=1, detail="out of reach"),
        RoundNote(outcome="joined", replica=1, step=30, base=1, round=4, replicas=[0, 1],
                  stragglers=[2], deadline=True, closed_by=0, waited_s=3.0, sent_bytes=100),
    ]  # fmt: skip
    events: list[Event] = [Round(run_id="r1", at=HUB0 + i, worker="t", note=n)
                           for i, n in enumerate(notes)]  # fmt: skip
    found = vitals(replica, events)["rounds"]
    assert found["replica"] == 1 and found["replicas"] == 3 and found["waited_s"] == 3.5
    assert [(n["outcome"], n["round"], n["bytes"]) for n in found["each"]] == [
        ("joined", 1, 300),
        ("skipped", 1, 0),
        ("joined", 4, 100),
    ]
    assert found["each"][2]["stragglers"] == [2] and found["each"][2]["deadline"]
    assert vitals(record(RunState.RUNNING), [])["rounds"] is None
