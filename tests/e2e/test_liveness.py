"""A healthy run is never taken for a dead one: ten minutes beside two CPU hogs, with the
reaper judging every trainer's pulse (`BATON_SILENT_AFTER`, 1.5 s) and every closed
connection, and no run is handed over.

The stack, the hogs and the test run pinned to one core of the machine: two hogs there
leave a stack's process a third of it while they run, harsher than two hogs on two cores
(half of each) — and the rest of CI keeps the other core. The job is the character model
with a plain DataLoader, its runs back to back on both trainers for the whole soak, each
held to its reference: one attempt, nothing fenced, handed over or dispatched again,
weights bitwise equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.contracts import JobSpec, RunState
from shared.contracts.events import Fenced, HandedOver, Redispatched, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack

SOAK_S = float(os.environ.get("BATON_SOAK_S", "600"))
"""How long the runs go on beside the hogs (ten minutes; shorter only to try the test)."""

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(SOAK_S + 900)]
HOGS = 2


def charlm(total: int, pace: float, key: str) -> JobSpec:
    return job(
        name="charlm-soak", entry_point="examples.charlm:train", total_steps=total, seed=5,
        checkpoint={"every_steps": 25}, config={"data": "cursor", "pace": pace},
        idempotency_key=key,
    )  # fmt: skip


@contextlib.contextmanager
def one_core_with_hogs() -> Iterator[int]:
    """This process and all it starts from now on pinned to one core, beside `HOGS` busy
    processes; undone however the block ends."""
    before = os.sched_getaffinity(0)
    core = max(before)
    os.sched_setaffinity(0, {core})
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(HOGS):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield core
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        os.sched_setaffinity(0, before)


async def test_ten_minutes_beside_two_cpu_hogs_hand_no_healthy_run_over(tmp_path: Path) -> None:
    with one_core_with_hogs() as core:
        async with Stack(tmp_path / "stack", trainers=2, lease_ttl=10) as stack:
            nc = await stack.client()
            total = 200
            ref = await finished(nc, await submit(nc, charlm(total, 0.0, "ref")), timeout=600)
            assert ref.state is RunState.COMPLETED and ref.digest
            print(f"pinned to core {core} with {HOGS} hogs; soaking {SOAK_S:.0f} s")
            started = time.monotonic()
            n = 0
            while time.monotonic() - started < SOAK_S:
                # Two at a time, one on each trainer, paced to last about a minute each.
                keys = [f"soak-{n}", f"soak-{n + 1}"]
                n += 2
                runs = [await submit(nc, charlm(total, 0.25, k)) for k in keys]
                logs = [EventLog(nc, r) for r in runs]
                records = await asyncio.gather(*(finished(nc, r, timeout=900) for r in runs))
                for run_id, log, record in zip(runs, logs, records, strict=True):
                    assert record.state is RunState.COMPLETED, (run_id, record)
                    assert record.digest == ref.digest, f"{run_id}: weights differ"
                    lost = log.of(HandedOver) + log.of(Fenced) + log.of(Redispatched)
                    assert not lost, f"{run_id} was taken for a dead one: {lost}"
                    assert record.attempts == 1 and len(log.of(Started)) == 1, log.of(Started)
                    log.close()
            print(f"{n} runs over {time.monotonic() - started:.0f} s, none handed over")
