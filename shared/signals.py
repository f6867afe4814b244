"""What a stop signal means, given the ones before it — for `baton up`, `baton join` and
every service: the first asks to stop (gracefully: a trainer checkpoints and hands its run
over), a later one to hurry.

A repeat within `min_gap_s` is the same request delivered twice, not a second one. Relays
signal a process and its whole group or job at once — GNU `timeout`, a `kill 0`, systemd's
default `KillMode=control-group`, Slurm ending an allocation — while the process's own
supervisor relays the same stop to it a moment later; neither may cost a trainer its grace.
"""

from __future__ import annotations

import asyncio

REPEAT_S = 0.5
"""A second signal sooner than this after the first is the first one again."""


class StopRequests:
    def __init__(
        self, stop: asyncio.Event, hurry: asyncio.Event, min_gap_s: float = REPEAT_S
    ) -> None:
        self.stop = stop
        self.hurry = hurry
        self.min_gap_s = min_gap_s
        self._first_at: float | None = None

    def request(self, now: float) -> None:
        if self._first_at is None and not self.stop.is_set():
            self._first_at = now
            self.stop.set()
        elif self._first_at is None or now - self._first_at >= self.min_gap_s:
            self.hurry.set()
