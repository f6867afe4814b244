"""The goodput split on histories written out by hand: it always adds up to the wall time,
and each category is what its definition says."""

from __future__ import annotations

import pytest

from shared.contracts.events import (
    Accepted,
    CheckpointCommitted,
    Completed,
    Event,
    Fenced,
    Preempted,
    Progress,
    Restored,
    Started,
)
from shared.history.goodput import CATEGORIES, Goodput, goodput

RUN = "r1"


def steps(
    worker: str, first: int, last: int, t0: float, step_s: float, stall_s: float = 0.0
) -> list[Progress]:
    """Progress every 10 steps from `first` (exclusive) to `last`, one step per `step_s`."""
    out = []
    for k in range(first + 10, last + 1, 10):
        at = t0 + (k - first) * step_s
        out.append(Progress(run_id=RUN, step=k, total_steps=100, worker=worker, at=at,
                            stall_s=stall_s))  # fmt: skip
    return out


def started(worker: str, token: int, attempt: int, start: int, at: float) -> Started:
    return Started(run_id=RUN, worker=worker, token=token, attempt=attempt, start_step=start, at=at)


def restored(worker: str, step: int, at: float, took: float = 0.0) -> Restored:
    return Restored(run_id=RUN, worker=worker, step=step, at=at, restore_s=took)


def commit(step: int, token: int, at: float) -> CheckpointCommitted:
    return CheckpointCommitted(run_id=RUN, step=step, token=token, manifest="m", bytes=1, at=at)


def adds_up(g: Goodput) -> None:
    assert sum(g.seconds().values()) == pytest.approx(g.wall_s)
    assert list(g.seconds()) == list(CATEGORIES)


def test_one_kill_splits_into_what_each_category_means() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, 1, 0, at=1.0),
        restored("w1", 0, at=1.5),
        *steps("w1", 0, 40, 1.5, 0.1),
        commit(50, 1, at=6.55),
        *steps("w1", 40, 80, 5.5, 0.1),  # the last sign of life: step 80 at 9.5; then killed
        started("w2", 2, 2, 50, at=12.0),
        restored("w2", 50, at=12.5, took=0.2),
        *steps("w2", 50, 100, 12.5, 0.1),  # step 100 at 17.5
        Completed(run_id=RUN, step=100, digest="d", at=17.6),  # after the final commit
    ]
    g = goodput(events)
    assert g is not None and g.finished and g.attempts == 2
    adds_up(g)
    assert g.wall_s == pytest.approx(17.6)
    assert g.queued_s == pytest.approx(1.0)
    assert g.startup_s == pytest.approx(0.5 + 0.3)
    assert g.restore_s == pytest.approx(0.2)
    assert g.steps_redone == 30  # the first attempt reached 80; the second resumed at 50
    assert g.wasted_s == pytest.approx(30 * 0.1)
    assert g.productive_s == pytest.approx(50 * 0.1 + 50 * 0.1)
    assert g.recovery_s == pytest.approx(12.0 - 9.5)
    assert g.checkpoint_s == pytest.approx(0.1)
    assert g.other_s == pytest.approx(0.0, abs=1e-9)
    assert g.goodput == pytest.approx(10.0 / 17.6)


def test_checkpoint_stalls_are_not_step_time() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, 1, 0, at=0.0),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 100, 0.0, 0.1, stall_s=0.4),  # 10 s, of which 0.4 s blocked
        Completed(run_id=RUN, step=100, digest="d", at=10.0),
    ]
    g = goodput(events)
    assert g is not None
    adds_up(g)
    assert g.checkpoint_s == pytest.approx(0.4)
    assert g.productive_s == pytest.approx(9.6)
    assert g.wasted_s == 0 and g.recovery_s == 0


def test_a_preemption_that_lost_no_step_wastes_nothing() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, 1, 0, at=0.0),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 50, 0.0, 0.1),
        commit(50, 1, at=5.1),
        Preempted(run_id=RUN, worker="w1", step=50, at=5.2),
        started("w2", 2, 2, 50, at=5.3),
        restored("w2", 50, at=5.3),
        *steps("w2", 50, 100, 5.3, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=10.3),
    ]
    g = goodput(events)
    assert g is not None
    adds_up(g)
    assert g.steps_redone == 0 and g.wasted_s == 0
    assert g.checkpoint_s == pytest.approx(0.2)  # the preemption's checkpoint and commit
    assert g.recovery_s == pytest.approx(0.1)
    assert g.productive_s == pytest.approx(10.0)


def test_a_fenced_zombie_overlapping_its_successor_counts_once() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, 1, 0, at=0.0),
        restored("w1", 0, at=0.0),
        *steps("w1", 0, 30, 0.0, 0.1),
        commit(30, 1, at=3.05),
        started("w2", 2, 2, 30, at=5.0),  # w1 was silent past its TTL
        restored("w2", 30, at=5.0),
        *steps("w1", 30, 50, 3.0, 0.1),  # w1 wakes up and trains on, a zombie, until 5.0
        Fenced(run_id=RUN, worker="w1", token=1, reason="lease lost", at=5.5),
        *steps("w2", 30, 100, 5.0, 0.1),
        Completed(run_id=RUN, step=100, digest="d", at=12.0),
    ]
    g = goodput(events)
    assert g is not None
    adds_up(g)
    assert g.wall_s == pytest.approx(12.0)
    assert g.steps_redone == 20  # w1 reached 50, w2 resumed at 30
    assert g.productive_s + g.wasted_s == pytest.approx(5.0 + 7.0)


def test_a_live_run_counts_until_now_and_a_queued_one_is_all_queue() -> None:
    queued = goodput([Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0)], now=4)
    assert queued is not None and queued.queued_s == 4 and queued.goodput == 0
    assert not queued.finished
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=0.0),
        started("w1", 1, 1, 0, at=1.0),
        restored("w1", 0, at=1.0),
        *steps("w1", 0, 30, 1.0, 0.1),
    ]
    g = goodput(events, now=5.0)
    assert g is not None and not g.finished
    adds_up(g)
    assert g.wall_s == 5.0 and g.queued_s == 1.0
    assert g.productive_s == pytest.approx(3.0 + 1.0)  # since its last progress: in flight
    assert g.checkpoint_s == 0


def test_runs_sum() -> None:
    a = Goodput(wall_s=10, productive_s=8, queued_s=2, attempts=1, finished=True)
    b = Goodput(wall_s=5, productive_s=4, recovery_s=1, attempts=2, finished=True, steps_redone=3)
    total = a + b
    assert (total.wall_s, total.productive_s, total.attempts, total.steps_redone) == (15, 12, 3, 3)
    assert total.goodput == pytest.approx(0.8)
    assert goodput([]) is None
