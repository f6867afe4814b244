"""Recoveries by cause, on histories written out by hand: each interruption's cause is how
the attempt before it ended, and its time runs from that attempt's last sign of life to the
next one's first step (less a pause for a human)."""

from __future__ import annotations

import pytest

from shared.contracts.events import (
    Accepted,
    AttemptFailed,
    Event,
    Fenced,
    Guarded,
    HandedOver,
    Paused,
    Preempted,
    Progress,
    RankLost,
    Resumed,
)
from shared.history.recovery import Recovery, by_cause, recoveries
from tests.shared.history.test_goodput import RUN, restored, started


def progress(worker: str, step: int, at: float) -> Progress:
    return Progress(run_id=RUN, step=step, total_steps=100, worker=worker, at=at)


def attempt(worker: str, token: int, n: int, start: int, at: float) -> list[Event]:
    """Started at `at`, restored 1 s later, stepping from 2 s later: steps start+10, +20."""
    return [
        started(worker, token, n, start, at), restored(worker, start, at + 1),
        progress(worker, start + 10, at + 2), progress(worker, start + 20, at + 3),
    ]  # fmt: skip


def test_each_interruption_has_its_cause_and_its_time() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        *attempt("w1", 1, 1, 0, at=1.0),  # last sign of life: 4.0
        Preempted(run_id=RUN, worker="w1", step=20, at=4.5),
        *attempt("w2", 2, 2, 20, at=5.0),  # steps again at 7.0
        HandedOver(run_id=RUN, worker="w2", token=2, reason="its trainer process died (…)", at=9),
        *attempt("w3", 3, 3, 30, at=10.0),  # from 8.0 to 12.0
        HandedOver(run_id=RUN, worker="w3", token=3, reason="its lease expired: …", at=15),
        *attempt("w4", 4, 4, 40, at=16.0),  # from 13.0 to 18.0
        RankLost(run_id=RUN, worker="w4", epoch=4, rank=1, lost="w9", reason="gone", at=19.5),
        *attempt("w5", 5, 5, 50, at=20.0),  # from 19.0 to 22.0
        AttemptFailed(run_id=RUN, worker="w5", attempt=5, reason="boom", at=23.5),
        *attempt("w6", 6, 6, 60, at=24.0),  # from 23.0 to 26.0
        Guarded(
            run_id=RUN,
            worker="w6",
            step=75,
            metric="loss",
            value="nan",
            rule="non_finite",
            action="rollback",
            good_step=70,
            at=27.5,
        ),
        *attempt("w7", 7, 7, 70, at=28.0),  # from 27.0 to 30.0
    ]
    found = recoveries(events)
    assert [(r.cause, r.seconds) for r in found] == [
        ("preemption", 3.0), ("process kill", 4.0), ("host loss", 5.0), ("rank loss", 3.0),
        ("failure", 3.0), ("divergence", 3.0),
    ]  # fmt: skip
    assert found[0] == Recovery(cause="preemption", seconds=3.0, from_step=20, to_step=20)
    assert by_cause(found)["preemption"] == (1, 3.0)


def test_a_partitioned_attempt_is_fenced_after_its_successor_started() -> None:
    events: list[Event] = [
        *attempt("edge", 1, 1, 0, at=1.0),  # last sign of life 4.0
        *attempt("hub", 2, 2, 10, at=9.0),  # steps at 11.0
        Fenced(run_id=RUN, worker="edge", token=1, reason="taken over", at=12.0),
    ]
    assert [(r.cause, r.seconds) for r in recoveries(events)] == [("partition", 7.0)]


def test_a_pause_for_a_human_is_not_a_recovery() -> None:
    events: list[Event] = [
        *attempt("w1", 1, 1, 0, at=1.0),
        Paused(run_id=RUN, reason="look", step=20, at=4.5),
        Resumed(run_id=RUN, reason="ok", at=100.0),
        *attempt("w1", 2, 2, 20, at=101.0),
    ]
    assert recoveries(events) == []


@pytest.mark.parametrize("worker", ["w1", "w2"])
def test_an_attempt_that_never_stepped_prolongs_the_interruption(worker: str) -> None:
    events: list[Event] = [
        *attempt("w1", 1, 1, 0, at=1.0),
        Preempted(run_id=RUN, worker="w1", step=20, at=4.5),
        started(worker, 2, 2, 20, at=5.0),
        Preempted(run_id=RUN, worker=worker, step=20, at=5.5),
        *attempt("w3", 3, 3, 20, at=6.0),
    ]
    # One interruption, from the last step (4.0) to the next first step (8.0).
    assert [(r.cause, r.seconds) for r in recoveries(events)] == [("preemption", 4.0)]
