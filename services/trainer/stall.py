"""Stall detection, on by default: an attempt whose training process stops stepping while
its trainer lives is warned of, then stopped, and the job's failure policy follows.

The trainer sees every step its training process reports, so it needs no setting to know
what "too long" is for this run: the bound is `factor` times the median step time of the
attempt's recent steps (each report's interval divided by the steps it covers), never less
than `floor_s`. Until the attempt has stepped a few times the bound is `first_s` (imports,
loading the checkpoint, the first batches). A job's own `limits.stall_timeout_s` replaces
all of it. A long but steady step moves the median with it, so a run that is merely slow is
never flagged; checkpoints block the loop briefly and are outliers the median ignores.

    no step for the bound           a `warning` event (kind `stalled`), once per stall
    a step after that               a `stall_recovered` event; the watch goes on
    no step for 1.5 x the bound     the attempt is stopped: a failed attempt of user code

A run whose last attempt was stopped for a stall is not new: its step time is known (the
record's `stall`), so once the next attempt has restored its checkpoint its bound follows
that step time rather than `first_s`, and it is stopped at the bound itself (it was warned
of last time). If it hangs after the same step again, the failure policy does not retry
it (`transitions.count_failure`): a hang that repeats would otherwise hold a GPU for the
first-steps bound again in every retry.

The watch ends once the run's last step is done (its final checkpoint's upload may take
long, and is bounded by the commit's own wait) and when the attempt is asked to stop (its
grace bounds that). A trainer that is itself hung stops renewing its lease, and its run is
handed over (`shared.state.handover`): nothing here depends on the trainer being healthy
beyond its event loop turning.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from shared.waits import wait_set

SAMPLES = 32
"""Recent steps the median is taken over."""
MIN_SAMPLES = 3
"""Step reports before the bound follows the run's own step time."""
STOP_AFTER = 1.5
"""The attempt is stopped at this many times the bound (warned at once the bound)."""


@dataclass(frozen=True)
class Bounds:
    """How long is too long: see the module's docstring."""

    factor: float
    floor_s: float
    first_s: float
    explicit_s: float | None = None
    """The job's `limits.stall_timeout_s`: when set, the bound whatever the steps say."""
    known_step_s: float | None = None
    """The run's step time from an attempt before this one that stalled (the record's
    `stall`): the bound from the restore on, and the stop at the bound itself."""

    @property
    def stop_after(self) -> float:
        """The stop, in bounds: the warning came in the attempt that stalled before."""
        return 1.0 if self.known_step_s is not None else STOP_AFTER


class StallWatch:
    def __init__(self, bounds: Bounds, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.clock = clock
        self.step: int | None = None
        self.last = clock()
        """When the last step was reported (or the attempt began)."""
        self._per_step: deque[float] = deque(maxlen=SAMPLES)
        self._moved = asyncio.Event()
        self.warned = False
        self.done = False
        self.held = False

    def knowing(self, step_s: float | None) -> None:
        """The run's step time from the stalled attempt before this one (see `Bounds`); None
        when that one hung before it was measured, which leaves the floor."""
        self.bounds = replace(self.bounds, known_step_s=step_s or 0.0)

    def bound(self) -> float:
        """Seconds without a step that make a stall, as of now."""
        b = self.bounds
        if b.explicit_s is not None:
            return b.explicit_s
        if len(self._per_step) < MIN_SAMPLES:
            if b.known_step_s is not None and self.step is not None:  # restored: not new
                return max(b.floor_s, b.factor * b.known_step_s)
            return max(b.first_s, b.floor_s)
        return max(b.floor_s, b.factor * statistics.median(self._per_step))

    def step_s(self) -> float | None:
        """The median step time of the recent steps (None: too few yet), else the known."""
        if len(self._per_step) < MIN_SAMPLES:
            return self.bounds.known_step_s
        return statistics.median(self._per_step)

    def stepped(self, step: int, last: bool = False) -> None:
        """The training process reported `step` (`last`: the run's final step)."""
        now = self.clock()
        if self.step is not None and step > self.step:
            self._per_step.append((now - self.last) / (step - self.step))
        if self.step is None or step > self.step:
            self.step, self.last = step, now
            self._moved.set()
        if last:
            self.finish()

    def hold(self, on: bool) -> None:
        """While `on`, the training process waits on others (a replicated run's outer round,
        bounded by its deadline), which is no stall; the quiet time restarts when it ends."""
        self.held = on
        self.last = self.clock()
        self._moved.set()

    def finish(self) -> None:
        """Nothing more to watch: the last step is done, or the attempt is stopping."""
        self.done = True
        self._moved.set()

    async def watch(
        self,
        warn: Callable[[float, int], Awaitable[None]],
        recovered: Callable[[float, int], Awaitable[None]],
        stop: Callable[[float, int], None],
    ) -> None:
        """Until the watch is done or the attempt is stopped: `warn(quiet_s, step)` once per
        stall, `recovered(quiet_s, step)` when it steps again, `stop(quiet_s, step)` when
        it did not in time (then the watch ends)."""
        warned_at = self.last
        while not self.done:
            if self.held:
                self._moved.clear()
                await self._moved.wait()
                continue
            quiet = self.clock() - self.last
            bound = self.bound()
            step = self.step or 0
            if self.warned and self.last != warned_at:  # it moved since the warning
                self.warned = False
                await recovered(self.last - warned_at, step)
            if quiet >= bound * self.bounds.stop_after:
                stop(quiet, step)
                return
            if quiet >= bound and not self.warned:
                self.warned, warned_at = True, self.last
                await warn(quiet, step)
            deadline = bound * (self.bounds.stop_after if self.warned else 1.0)
            self._moved.clear()
            await wait_set(self._moved, max(0.0, deadline - quiet) + 0.01)
