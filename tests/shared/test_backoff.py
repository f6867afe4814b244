"""Capped exponential back-off and the retry loop, with the sleeps recorded, never waited."""

from __future__ import annotations

import logging

import pytest

from shared.backoff import Backoff, retrying


class Sleeps:
    """Stands in for `asyncio.sleep`: records each requested delay and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


class Flaky:
    """A call that raises each of `errors` in turn, then returns `result`."""

    def __init__(self, errors: list[BaseException], result: str = "done") -> None:
        self.errors = list(errors)
        self.result = result
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result


def test_delays_double_up_to_the_cap() -> None:
    b = Backoff(first=0.5, most=5.0)
    got = [b.next() for _ in range(7)]
    assert got == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0], got


def test_factor_and_a_cap_below_the_doubling() -> None:
    b = Backoff(0.1, 2.0, factor=3.0)
    got = [b.next() for _ in range(5)]
    assert got == pytest.approx([0.1, 0.3, 0.9, 2.0, 2.0]), got


def test_reset_starts_again_from_first() -> None:
    b = Backoff(first=0.2, most=5.0)
    before = [b.next() for _ in range(3)]
    b.reset()
    after = [b.next() for _ in range(2)]
    assert before == [0.2, 0.4, 0.8] and after == [0.2, 0.4], (before, after)


def test_full_jitter_draws_below_the_plain_delay() -> None:
    drawn: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        drawn.append((low, high))
        return high / 2

    b = Backoff(0.1, 0.3, jitter=True, uniform=uniform)
    got = [b.next() for _ in range(4)]
    assert drawn == [(0.0, 0.1), (0.0, 0.2), (0.0, 0.3), (0.0, 0.3)], drawn
    assert got == [0.05, 0.1, 0.15, 0.15], got


def test_full_jitter_by_default_stays_within_bounds() -> None:
    b = Backoff(1.0, 4.0, jitter=True)
    for bound in (1.0, 2.0, 4.0, 4.0, 4.0):
        d = b.next()
        assert 0.0 <= d <= bound, (d, bound)


async def test_retries_listed_exceptions_until_success() -> None:
    call = Flaky([TimeoutError(), ConnectionError(), TimeoutError()])
    sleeps = Sleeps()
    got = await retrying(
        call,
        retry_on=(TimeoutError, ConnectionError),
        what="the thing",
        backoff=Backoff(first=0.5, most=1.0),
        sleep=sleeps,
    )
    assert got == "done" and call.calls == 4, (got, call.calls)
    assert sleeps.delays == [0.5, 1.0, 1.0], sleeps.delays


async def test_logs_each_retry_with_what_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    mine = logging.getLogger("baton.test-backoff")
    await retrying(
        Flaky([TimeoutError(), TimeoutError()]),
        retry_on=(TimeoutError,),
        what="publish to x.y not confirmed",
        backoff=Backoff(0.1, 2.0),
        log=mine,
        level=logging.INFO,
        sleep=Sleeps(),
    )
    seen = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    line = (
        "baton.test-backoff",
        logging.INFO,
        "publish to x.y not confirmed (TimeoutError); retrying",
    )
    assert seen == [line, line], seen


async def test_default_logger_and_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    await retrying(
        Flaky([TimeoutError()]),
        retry_on=(TimeoutError,),
        what="the hub's streams is not reachable",
        backoff=Backoff(0.5, 5.0),
        sleep=Sleeps(),
    )
    seen = [(r.name, r.levelno) for r in caplog.records]
    assert seen == [("baton.backoff", logging.WARNING)], seen


async def test_other_exceptions_propagate_at_once() -> None:
    call = Flaky([TimeoutError(), ValueError("bug")])
    sleeps = Sleeps()
    with pytest.raises(ValueError, match="bug"):
        await retrying(
            call, retry_on=(TimeoutError,), what="x", backoff=Backoff(0.5, 5.0), sleep=sleeps
        )
    assert call.calls == 2 and sleeps.delays == [0.5], (call.calls, sleeps.delays)


async def test_attempts_bound_the_calls_and_reraise_the_last_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    last = TimeoutError("third")
    call = Flaky([TimeoutError("first"), TimeoutError("second"), last])
    sleeps = Sleeps()
    with pytest.raises(TimeoutError) as raised:
        await retrying(
            call,
            retry_on=(TimeoutError,),
            what="x",
            backoff=Backoff(0.1, 2.0),
            attempts=3,
            sleep=sleeps,
        )
    assert raised.value is last and call.calls == 3, (raised.value, call.calls)
    # No wait, and no "retrying" line, after the last attempt.
    assert sleeps.delays == [0.1, 0.2] and len(caplog.records) == 2, (sleeps.delays, caplog.records)


async def test_attempts_zero_means_no_bound() -> None:
    call = Flaky([TimeoutError()] * 20)
    sleeps = Sleeps()
    got = await retrying(
        call, retry_on=(TimeoutError,), what="x", backoff=Backoff(0.1, 2.0), sleep=sleeps
    )
    assert got == "done" and call.calls == 21 and len(sleeps.delays) == 20, call.calls
    assert max(sleeps.delays) == 2.0, sleeps.delays


async def test_give_up_ends_the_loop_with_none(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    call = Flaky([TimeoutError()] * 5)
    sleeps = Sleeps()
    asked: list[int] = []

    def give_up() -> bool:
        asked.append(call.calls)
        return call.calls >= 3

    got = await retrying(
        call,
        retry_on=(TimeoutError,),
        what="x",
        backoff=Backoff(0.5, 5.0),
        give_up=give_up,
        sleep=sleeps,
    )
    # Asked after each failure, before logging and waiting; never before the first call.
    assert got is None and asked == [1, 2, 3], (got, asked)
    assert sleeps.delays == [0.5, 1.0] and len(caplog.records) == 2, (sleeps.delays, caplog.records)


async def test_give_up_is_not_asked_after_a_success() -> None:
    def never() -> bool:
        pytest.fail("asked without a failure")

    got = await retrying(
        Flaky([]),
        retry_on=(TimeoutError,),
        what="x",
        backoff=Backoff(0.5, 5.0),
        give_up=never,
        sleep=Sleeps(),
    )
    assert got == "done", got


async def test_a_result_that_is_none_is_returned_as_is() -> None:
    async def nothing() -> str | None:
        return None

    got = await retrying(nothing, retry_on=(TimeoutError,), what="x", backoff=Backoff(0.5, 5.0))
    assert got is None
