"""Fault points: named places where a test may have the process die, to prove that a crash
exactly there loses nothing.

`BATON_FAULTS` names the armed points, comma-separated; a process dies by SIGKILL — no
cleanup, no `finally`, as a power cut or the OOM killer would — the first time it reaches
one. Unset (always, outside tests) nothing is armed and `hit` is a set lookup.

    after-ending-written   a run's terminal record is written, its event not yet published
"""

from __future__ import annotations

import os
import signal

ENV = "BATON_FAULTS"
POINTS = frozenset({"after-ending-written"})

_armed = frozenset(p.strip() for p in os.environ.get(ENV, "").split(",") if p.strip())
if unknown := _armed - POINTS:
    raise RuntimeError(f"{ENV} names unknown fault points: {', '.join(sorted(unknown))}")


def hit(point: str) -> None:
    assert point in POINTS, point
    if point in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
