"""What an ended run is charged, on histories written out by hand: its productive
trainer-seconds and the whole of the attempts its own code failed, at its price per device
kind and times its ranks; never redone steps, recovery or queueing."""

from __future__ import annotations

import pytest

from shared.contracts.events import (
    Accepted,
    AttemptFailed,
    CheckpointCommitted,
    Completed,
    Event,
    Failed,
    Guarded,
    Round,
    Started,
)
from shared.contracts.pools import units
from shared.contracts.rounds import RoundNote
from shared.history.goodput import goodput
from shared.ledger.charges import charge
from tests.shared.history.test_goodput import RUN, restored, steps

PRICE = {"cpu": 0.01, "cuda": 0.1}


def started(worker: str, token: int, at: float, start: int = 0, **kw: object) -> Started:
    return Started(
        run_id=RUN, worker=worker, token=token, attempt=token, start_step=start, at=at, **kw
    )  # type: ignore[arg-type]


def commit(step: int, token: int, at: float) -> CheckpointCommitted:
    return CheckpointCommitted(run_id=RUN, step=step, token=token, manifest="m", bytes=1, at=at)


def test_an_uninterrupted_run_is_charged_its_productive_seconds() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=5.0, device="cpu"),  # 5 s queued: free
        restored("w1", 0, at=6.0, took=1.0),  # a second's restore: free
        *steps("w1", 0, 100, 6.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=16.0),
    ]
    g = goodput(events)
    c = charge(events, PRICE)
    assert g is not None and c.productive_s == pytest.approx(g.productive_s) == pytest.approx(10)
    assert c.failed_s == 0 and c.free_s == pytest.approx(1.0)
    assert c.charged == units(10 * 0.01)


def test_steps_redone_after_a_kill_and_the_recovery_are_free() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cpu"),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 50, 0.0, 0.1),
        commit(30, 1, at=3.05),
        # w1 killed after step 50: w2 resumes at 30 after 2 s of recovery.
        started("w2", 2, at=7.0, start=30, device="cpu"),
        restored("w2", 30, at=7.0),
        *steps("w2", 30, 100, 7.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=14.0),
    ]
    g = goodput(events)
    c = charge(events, PRICE)
    assert g is not None and g.steps_redone == 20 and g.wasted_s > 0
    assert c.productive_s == pytest.approx(g.productive_s)
    assert c.free_s == pytest.approx(g.wasted_s), (c, g)  # the redone steps, not charged
    assert c.charged == units(g.productive_s * 0.01)


def test_an_attempt_its_own_code_failed_is_charged_whole() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cuda"),
        restored("w1", 0, at=1.0, took=1.0),
        *steps("w1", 0, 40, 1.0, 0.1),
        commit(20, 1, at=3.05),
        AttemptFailed(run_id=RUN, worker="w1", attempt=1, reason="boom", at=5.0),
        started("w2", 2, at=7.0, start=20, device="cuda"),
        restored("w2", 20, at=7.0),
        *steps("w2", 20, 100, 7.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=15.0),
    ]
    c = charge(events, PRICE)
    # The failed attempt: 5 s in all (restore, steps, the redone ones), all charged.
    assert c.productive_s + c.failed_s == pytest.approx(5.0 + 8.0), c
    assert c.charged == units((c.productive_s + c.failed_s) * 0.1)


def test_a_failure_of_batons_own_is_not_the_owners() -> None:
    base: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cpu"),
        restored("w1", 0, at=1.0, took=1.0),
        *steps("w1", 0, 40, 1.0, 0.1),
        commit(40, 1, at=5.0),
    ]
    theirs = charge([*base, Failed(run_id=RUN, reason="boom", at=6.0)], PRICE)
    ours = charge([*base, Failed(run_id=RUN, reason="gave up after 100 deliveries", at=6.0)],
                  PRICE)  # fmt: skip
    assert theirs.failed_s > 0 and ours.failed_s == 0, (theirs, ours)


def test_ranks_and_device_kinds_price_each_attempt() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cuda", ranks=2),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 100, 0.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=10.0),
    ]
    c = charge(events, PRICE)
    assert c.productive_s == pytest.approx(20.0)  # 10 s on two trainers
    assert c.charged == units(20.0 * 0.1)
    assert charge(events, {"*": 0.5}).charged == units(20.0 * 0.5)  # `*`: any other kind


def _failed_once(end: Event) -> list[Event]:
    return [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cpu"),
        restored("w1", 0, at=1.0, took=1.0),
        *steps("w1", 0, 40, 1.0, 0.1),
        commit(20, 1, at=3.05),
        end,
        started("w2", 2, at=7.0, start=20, device="cpu"),
        restored("w2", 20, at=7.0),
        *steps("w2", 20, 100, 7.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=15.0),
    ]


def test_an_attempt_a_lost_machine_or_hardware_ended_is_not_the_owners() -> None:
    """Counted against the run's retries, never charged: a group that broke a second time
    from one checkpoint because a rank's trainer went silent, a process a SIGBUS killed."""

    def failed(fault: str) -> Event:
        return AttemptFailed(run_id=RUN, worker="w1", attempt=1, reason="x", fault=fault, at=5.0)

    own = charge(_failed_once(failed("")), PRICE)
    for fault in ("machine", "hardware"):
        theirs = charge(_failed_once(failed(fault)), PRICE)
        assert own.failed_s > 0 and theirs.failed_s == 0, (fault, theirs)
        assert theirs.productive_s == pytest.approx(own.productive_s)
        assert theirs.charged < own.charged


def test_a_guards_pause_is_not_a_failure_its_stop_is() -> None:
    def tripped(action: str) -> Event:
        return Guarded(run_id=RUN, worker="w1", step=40, metric="loss", value="nan",
                       rule="non_finite", action=action, good_step=20, at=5.0)  # fmt: skip

    paused = charge(_failed_once(tripped("pause")), PRICE)
    stopped = charge(_failed_once(tripped("stop")), PRICE)
    assert paused.failed_s == 0 and stopped.failed_s > 0, (paused, stopped)


def test_every_attempt_of_a_replica_has_its_round_waits_taken_off() -> None:
    """A worker's second attempt (its trainer restarted) waits for rounds too: its waits
    are its own, not all taken off its first attempt (a short one, here: a second of steps
    could not take three seconds of waits off)."""

    def waited(at: float) -> Round:
        note = RoundNote(outcome="joined", replica=0, step=1, base=0, round=1, waited_s=1.0)
        return Round(run_id=RUN, worker="w1", note=note, at=at)

    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, at=0.0, device="cpu"),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 10, 0.0, 0.1),
        commit(10, 1, at=1.05),
        started("w1", 2, at=3.0, start=10, device="cpu"),
        restored("w1", 10, at=3.0),
        *steps("w1", 10, 100, 3.0, 0.1),
        waited(5.0),
        waited(8.0),
        waited(11.0),
        Completed(run_id=RUN, step=100, digest="d", at=12.1),
    ]
    c = charge(events, PRICE)
    g = goodput(events)
    assert g is not None and g.rounds_s == pytest.approx(3.0), g
    assert c.productive_s == pytest.approx(g.productive_s), (c, g)  # every wait off
