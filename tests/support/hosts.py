"""A host that goes silent, as a test makes one: its trainer and every process under it
stopped (SIGSTOP), their sockets open and nothing sent, until the test wakes them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

from tests.support.stack import Stack, alive, children_of

SILENT_HOST_GOAL_S = 3.0
"""A silent host -> the next attempt's first step (docs/benchmarks.md, "Recovery")."""
LOADED_SLACK_S = 2.0
"""What a loaded machine may add to it: the reaper, the next trainer and its training
process starved of CPU. Measured on the three-node hub: 1.65 s on an idle machine, 1.72 s
beside two CPU hogs (`scripts/test-loaded.sh`)."""
SILENT_HOST_S = SILENT_HOST_GOAL_S + LOADED_SLACK_S


@contextlib.asynccontextmanager
async def stop_host(stack: Stack, trainer: str) -> AsyncIterator[float]:
    """Stop `trainer` and its processes; yields the time they were stopped; wakes them on
    leaving (they find themselves fenced, and stop their attempt)."""
    family = [stack.pid(trainer), *children_of(stack.pid(trainer))]
    at = time.time()
    for p in family:
        os.kill(p, signal.SIGSTOP)
    try:
        yield at
    finally:
        for p in family:
            if alive(p):
                os.kill(p, signal.SIGCONT)
