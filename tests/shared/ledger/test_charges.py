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
    Started,
)
from shared.contracts.pools import units
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
