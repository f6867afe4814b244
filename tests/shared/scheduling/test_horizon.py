"""Grants by time, without a broker: a run's expected seconds, and how much a pass grants a
site ahead — up to its horizon per trainer, in the queue's order, never past the count
ceiling, and never what a trainer free now could start."""

from __future__ import annotations

from collections.abc import Sequence

from shared.scheduling.horizon import MOST_AHEAD, Work, expected_s, per_trainer, room
from shared.scheduling.model import Action, Admit, Grant, Phase, Run, SiteRoom
from shared.scheduling.plan import plan
from tests.shared.scheduling.test_plan import queued, state


def test_a_runs_expected_seconds_come_from_its_jobs_speed_else_its_estimate() -> None:
    w = Work(job="j", steps=50, total_steps=100, estimate_s=40.0, ranks=2)
    # Measured speed first: 50 steps left x 0.5 s x 2 ranks.
    assert expected_s(w, {"j": 0.5}) == 50.0
    # Else the job's estimate, for the share of its steps left.
    assert expected_s(w, {"other": 9.0}) == 40.0
    assert expected_s(Work(job="j", steps=10, total_steps=10), {}) is None


def test_a_run_nobody_can_estimate_counts_half_the_horizon() -> None:
    # One trainer training a run of unknown length: one more is granted, as by count.
    h = room(1, 100.0, [None])
    assert h.seconds == 50.0 and h.fits()
    h.take(None)
    assert not h.fits()
    assert per_trainer(2, [None, 30.0], 100.0) == 40.0 and per_trainer(0, [], 100.0) is None


def runs(n: int, seconds: float, priority: int = 0) -> list[Run]:
    work = Work(job="j", steps=10, total_steps=10, estimate_s=seconds)
    return [queued(f"r{i:03}", priority=priority, grantable=True, work=work) for i in range(n)]


def granted(actions: Sequence[Action]) -> list[str]:
    return [a.run_id for a in actions if isinstance(a, Grant)]


def admitted(actions: Sequence[Action]) -> list[str]:
    return [a.run_id for a in actions if isinstance(a, Admit)]


def by_time(trainers: int, held: list[float | None], horizon_s: float, held_runs: int) -> SiteRoom:
    return SiteRoom(
        free=trainers * (1 + MOST_AHEAD) - held_runs, spare=trainers * MOST_AHEAD,
        time=room(trainers, horizon_s, held),
    )  # fmt: skip


def test_a_site_is_granted_until_its_trainers_hold_the_horizon() -> None:
    # Two trainers, each training a run with 20 s left; a horizon of 100 s each: 160 s
    # more, granted in 30 s runs until it is reached — the run that reaches it included.
    site = by_time(2, [20.0, 20.0], 100.0, held_runs=2)
    out = plan(state(0, *runs(20, 30.0), sites={"lab1": site}))
    assert granted(out.actions) == [f"r{i:03}" for i in range(6)], out.actions
    # The same queue by count (one ahead per trainer): two.
    out = plan(state(0, *runs(20, 30.0), sites={"lab1": SiteRoom(free=2, spare=2)}))
    assert len(granted(out.actions)) == 2


def test_a_pool_of_tiny_runs_is_granted_no_more_than_the_ceiling() -> None:
    site = by_time(2, [1.0, 1.0], 3600.0, held_runs=2)
    out = plan(state(0, *runs(500, 1.0), sites={"lab1": site}))
    assert len(granted(out.actions)) == 2 * MOST_AHEAD, len(granted(out.actions))


def test_grants_by_time_follow_the_queues_order() -> None:
    low = runs(10, 30.0, priority=0)
    high = [queued(f"h{i}", priority=5, grantable=True, work=low[0].work) for i in range(3)]
    site = by_time(1, [30.0], 100.0, held_runs=1)
    out = plan(state(0, *low, *high, sites={"lab1": site}))
    # 70 s of room: the three high-priority runs first (90 s), nothing after them.
    assert granted(out.actions) == ["h0", "h1", "h2"], out.actions


def test_a_long_horizon_never_takes_what_a_free_trainer_could_start() -> None:
    # Two trainers: the hub's, free, and the site's, training. The first run starts at the
    # hub; the rest, which no trainer of the hub's can start now, go to the site ahead.
    site = by_time(1, [10.0], 1000.0, held_runs=1)
    busy = Run("busy", "a", 0, -1.0, Phase.RUNNING, ranks=1, site="lab1")
    out = plan(state(2, busy, *runs(5, 30.0), sites={"lab1": site}, hub_free=1))
    assert admitted(out.actions) == ["r000"], out.actions
    assert granted(out.actions) == ["r001", "r002", "r003", "r004"], out.actions
    # The site's own trainers, free but for the runs granted to them, are not the hub's:
    # its trainers all free with two runs granted, the rest still go ahead to it.
    site = by_time(2, [30.0, 30.0], 1000.0, held_runs=2)
    out = plan(state(2, *runs(5, 30.0), sites={"lab1": site}))
    assert len(granted(out.actions)) == 5 and not admitted(out.actions), out.actions


def test_a_site_granted_by_time_still_gets_a_run_for_a_trainer_free_now() -> None:
    # Past its horizon, but one of its trainers is free now: that trainer gets a run.
    site = by_time(2, [500.0], 100.0, held_runs=1)
    s = state(0, *runs(3, 30.0), sites={"lab1": site})
    assert granted(plan(s).actions) == ["r000"]
