"""Capped exponential back-off, and the retry-until-it-works loop built on it.

Baton waits out outages rather than failing on them (a NATS server that is not up yet, a
hub behind a cut link, an object store that is down), so many places retry. They all wait
the same way: a short first delay, so that a blip costs little; doubling, so that a long
outage costs few attempts; and a cap, because the cap is how long a retry may lag behind
the end of the outage (a checkpoint waiting for its store, a run waiting for its record).
Each caller keeps its own first delay and cap, next to the reason for them.

`retrying` is the common loop: call until the call succeeds, waiting out the listed
exceptions (each retry logged with what is being retried), re-raising anything else at
once, and giving up when told to. The sleep is a parameter so that tests can record the
delays instead of waiting them out.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

_log = logging.getLogger("baton.backoff")


class Backoff:
    """The delays between attempts: `first`, then each `factor` times the one before, up to
    `most` (`first` itself is used as given). `reset()` starts again from `first`: after a
    success, when the next failure is a new outage rather than more of the same one.

    With `jitter`, `next()` returns a delay drawn uniformly from [0, d] ("full jitter") where
    d is the plain delay: clients that failed together, such as writers whose conditional
    writes collided, then do not retry in step and collide again. Without it the delays are
    exactly the sequence above.

    Not thread-safe; one Backoff serves one loop.
    """

    __slots__ = ("_delay", "factor", "first", "jitter", "most", "uniform")

    def __init__(
        self,
        first: float,
        most: float,
        *,
        factor: float = 2.0,
        jitter: bool = False,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self.first = first
        self.most = most
        self.factor = factor
        self.jitter = jitter
        self.uniform = uniform  # draws the jittered delay: a test may make it predictable
        self._delay = first

    def next(self) -> float:
        """The delay to wait now; the one after it grows by `factor`, capped at `most`."""
        delay = self._delay
        self._delay = min(delay * self.factor, self.most)
        return self.uniform(0.0, delay) if self.jitter else delay

    def reset(self) -> None:
        """Start again from `first`."""
        self._delay = self.first

    def __repr__(self) -> str:
        return (
            f"Backoff(first={self.first!r}, most={self.most!r}, factor={self.factor!r}, "
            f"jitter={self.jitter!r}, next={self._delay!r})"
        )


@overload
async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    what: str,
    backoff: Backoff,
    attempts: int = 0,
    give_up: None = None,
    log: logging.Logger | None = None,
    level: int = logging.WARNING,
    sleep: Callable[[float], Awaitable[object]] | None = None,
) -> T: ...


@overload
async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    what: str,
    backoff: Backoff,
    attempts: int = 0,
    give_up: Callable[[], bool],
    log: logging.Logger | None = None,
    level: int = logging.WARNING,
    sleep: Callable[[float], Awaitable[object]] | None = None,
) -> T | None: ...


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    what: str,
    backoff: Backoff,
    attempts: int = 0,
    give_up: Callable[[], bool] | None = None,
    log: logging.Logger | None = None,
    level: int = logging.WARNING,
    sleep: Callable[[float], Awaitable[object]] | None = None,
) -> T | None:
    """Await `call()` until it returns, and return what it returned.

    An exception in `retry_on` is waited out: unless this was the last attempt, the retry is
    logged as "<what> (<exception type>); retrying" on `log` (default: "baton.backoff") at
    `level`, and the next call comes after `backoff.next()` seconds. So `what` names what is
    being retried, or how it failed: "publish to X not confirmed", "the hub's streams is not
    reachable". Any other exception propagates at once, as does cancellation.

    `attempts` bounds the number of calls (0: no bound); after the last one its exception
    propagates. `give_up` is asked after each failure, before logging or waiting: True ends
    the loop with None (say, once the caller has been fenced and the result no longer
    matters). `sleep` waits (default: `asyncio.sleep`, looked up when needed).

    `backoff` is consumed: pass a fresh one per loop unless its state is meant to carry over.
    """
    logger = _log if log is None else log
    tried = 0
    while True:
        try:
            return await call()
        except retry_on as exc:
            if give_up is not None and give_up():
                return None
            tried += 1
            if attempts and tried >= attempts:
                raise
            logger.log(level, "%s (%s); retrying", what, type(exc).__name__)
            await (asyncio.sleep if sleep is None else sleep)(backoff.next())
