"""The stall watch on a clock the test moves: the bound follows the run's own steps, a
stall is warned of once, then stopped; a run that steps again is said to have recovered;
a run that is merely slow is never flagged."""

from __future__ import annotations

import asyncio

import pytest

from services.trainer.stall import MIN_SAMPLES, STOP_AFTER, Bounds, StallWatch

BOUNDS = Bounds(factor=10.0, floor_s=5.0, first_s=60.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bound_follows_the_median_step_with_a_floor() -> None:
    clock = Clock()
    watch = StallWatch(BOUNDS, clock)
    assert watch.bound() == 60.0  # before the run has stepped a few times
    watch.stepped(0)
    for step in range(1, MIN_SAMPLES + 1):
        clock.now += 2.0
        watch.stepped(step)
    assert watch.bound() == 20.0  # 10 x 2 s
    clock.now += 3.0
    watch.stepped(MIN_SAMPLES + 4)  # one report covering four steps: 0.75 s each
    assert watch.bound() == 20.0  # the median ignores one outlier
    fast = StallWatch(BOUNDS, clock)
    fast.stepped(0)
    for step in range(1, 10):
        clock.now += 0.01
        fast.stepped(step)
    assert fast.bound() == 5.0  # the floor
    explicit = StallWatch(Bounds(10.0, 5.0, 60.0, explicit_s=7.0), clock)
    assert explicit.bound() == 7.0


HOLD, RELEASE = -2, -3
"""Steps for `drive` that begin and end a wait for a round (`StallWatch.hold`)."""


async def drive(watch: StallWatch, clock: Clock, steps: list[tuple[float, int]]) -> list[str]:
    """Run the watch while the clock moves by each (seconds, step) — a step of -1 reports
    nothing, `HOLD`/`RELEASE` begin and end a wait for a round — and return what it said."""
    said: list[str] = []

    async def warn(quiet: float, step: int) -> None:
        said.append(f"warn {step}")

    async def recovered(quiet: float, step: int) -> None:
        said.append(f"recovered {step} after {quiet:.0f}")

    def stop(quiet: float, step: int) -> None:
        said.append(f"stop {step}")

    task = asyncio.create_task(watch.watch(warn, recovered, stop))
    for seconds, step in steps:
        await asyncio.sleep(0)
        clock.now += seconds
        if step >= 0:
            watch.stepped(step)
        elif step in (HOLD, RELEASE):
            watch.hold(step == HOLD)
        else:
            watch._moved.set()  # wake it to look at the clock, as its timer would
        for _ in range(5):
            await asyncio.sleep(0)
    watch.finish()
    await asyncio.wait_for(task, 5)
    return said


async def test_a_stall_is_warned_then_stopped() -> None:
    clock = Clock()
    watch = StallWatch(BOUNDS, clock)
    steady = [(1.0, s) for s in range(1, 8)]  # 1 s steps: bound 10 s
    said = await drive(watch, clock, [(0, 0), *steady, (10.5, -1), (5.0, -1)])
    assert said == ["warn 7", "stop 7"]


async def test_a_run_that_steps_again_recovers_and_is_watched_anew() -> None:
    clock = Clock()
    watch = StallWatch(BOUNDS, clock)
    steady = [(1.0, s) for s in range(1, 8)]
    again = [(1.0, s) for s in range(9, 14)]
    said = await drive(watch, clock, [(0, 0), *steady, (11.0, -1), (1.0, 8), *again])
    assert said == ["warn 7", "recovered 8 after 12"]


@pytest.mark.parametrize("step_s", [4.0, 30.0, 300.0])
async def test_a_slow_but_steady_run_is_never_flagged(step_s: float) -> None:
    clock = Clock()
    watch = StallWatch(Bounds(factor=10.0, floor_s=5.0, first_s=600.0), clock)
    said = await drive(watch, clock, [(0, 0), *[(step_s, s) for s in range(1, 30)]])
    assert said == []
    assert watch.bound() == max(5.0, 10 * step_s)
    assert STOP_AFTER > 1


async def test_a_replica_waiting_for_a_round_is_not_stalled() -> None:
    """A replicated run's replica standing still for an outer round (`hold`) is no stall,
    however long the round takes; the quiet time counts again from the end of the wait."""
    clock = Clock()
    watch = StallWatch(BOUNDS, clock)
    steady = [(1.0, s) for s in range(1, 8)]  # 1 s steps: bound 10 s
    a_round = [(0.0, HOLD), *[(10.0, -1)] * 10, (0.0, RELEASE)]  # 100 s without a step
    said = await drive(watch, clock, [(0, 0), *steady, *a_round, (9.0, -1), (0.5, 8)])
    assert said == []


async def test_a_run_that_hung_before_is_bound_by_its_known_step_from_its_restore() -> None:
    """The attempt after a stalled one: the first-steps bound only until it has restored;
    then the run's known step time (2 s: 10 x 2 = 20 s), and it is stopped at the bound
    itself, with no warning first (the attempt before was warned)."""
    clock = Clock()
    watch = StallWatch(BOUNDS, clock)
    watch.knowing(2.0)
    assert watch.bound() == 60.0  # still loading: the first-steps bound
    said = await drive(watch, clock, [(30.0, 150), (19.0, -1), (1.5, -1)])
    assert watch.bound() == 20.0
    assert said == ["stop 150"]
    unknown = StallWatch(BOUNDS, clock)
    unknown.knowing(None)  # it hung before its step time was measured: the floor
    unknown.stepped(150)
    assert unknown.bound() == 5.0
