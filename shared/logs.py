"""Logging a condition that lasts, such as a link that is down, once per change of state.

A retry loop that logs every failed try writes hundreds of lines during a long cut (a site
trainer's lease renewals every 0.5 s, its retried publishes), and the one line that says
when it began, or that it ended, drowns among them. A `Condition` logs instead:

* once when the failure starts: WARNING, with what fails and what goes on meanwhile;
* nothing while it keeps failing (DEBUG, for whoever asks for it);
* once when it recovers: INFO, with how long it lasted and how many tries failed.

Counting what failed for telemetry stays with the caller: a Condition only logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Condition:
    """Invariant: between two changes of state a Condition logs nothing above DEBUG — one
    WARNING when `failed` turns it on, one INFO when `ok` turns it off.

    `what` names what fails ("lab1-…: lease renewal"), `meanwhile` what goes on while it does
    ("training goes on"). `clock` (monotonic seconds) times the outage; a test may fake it.
    Not thread-safe: one event loop's tasks share one.
    """

    __slots__ = ("_clock", "_since", "failures", "log", "meanwhile", "what")

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        meanwhile: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.meanwhile = meanwhile
        self._clock = clock
        self._since: float | None = None
        self.failures = 0
        """Tries that failed since the condition began (0 while it is off)."""

    @property
    def failing(self) -> bool:
        """Whether the last try failed."""
        return self._since is not None

    def failed(self, why: BaseException | str) -> bool:
        """A try failed (`why`: its exception, or a word on it). True when this began the
        condition, which was then logged; a repeat is logged at DEBUG only."""
        reason = why if isinstance(why, str) else type(why).__name__
        self.failures += 1
        if self._since is not None:
            self.log.debug("%s failed again (%s), %d tries", self.what, reason, self.failures)
            return False
        self._since = self._clock()
        tail = f"; {self.meanwhile}" if self.meanwhile else ""
        self.log.warning("%s failed (%s)%s", self.what, reason, tail)
        return True

    def ok(self) -> bool:
        """A try succeeded. True when this ended the condition, which was then logged with
        how long it lasted and how many tries failed; otherwise nothing is logged."""
        if self._since is None:
            return False
        lasted = self._clock() - self._since
        tries, self._since, self.failures = self.failures, None, 0
        self.log.info(
            "%s recovered after %.1fs (%d %s failed)",
            self.what, lasted, tries, "try" if tries == 1 else "tries",
        )  # fmt: skip
        return True
