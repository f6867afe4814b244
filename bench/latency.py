"""Submit -> first step on an idle stack (nats-server and the services as processes, one
trainer): `--jobs` short jobs whose set-up is trivial, submitted `--every` seconds apart,
each timed from the client's publish to its `accepted`, `started`, `restored` and first
`progress` events (all clocks on this one host). The entry point's own part (importing its
module and building its model, before `restore()`) is the `restored` event's `setup_s`,
shown apart from Baton's.

    .venv/bin/python -m bench.latency [--jobs 20] [--every 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from shared.contracts.events import Accepted, Progress, Restored, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack

STAGES = ("accepted", "started", "restored", "first step")


async def main(jobs: int, every: float) -> None:
    got: dict[str, list[float]] = {s: [] for s in (*STAGES, "entry point's set-up")}
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=1, env={"BATON_LOG_LEVEL": "INFO"})
        await stack.start()
        try:
            nc = await stack.client()
            await finished(nc, await submit(nc, job(total_steps=5)), 60)  # warm the stack
            runs = []
            for i in range(jobs):
                t0 = time.time()
                run_id = await submit(nc, job(total_steps=5, idempotency_key=f"lat-{i}"))
                runs.append((t0, run_id, EventLog(nc, run_id)))
                await asyncio.sleep(max(0.0, t0 + every - time.time()))
            for t0, run_id, log in runs:
                await finished(nc, run_id, 60)
                first = {
                    "accepted": next(e for e in log.events if isinstance(e, Accepted)),
                    "started": next(e for e in log.events if isinstance(e, Started)),
                    "restored": next(e for e in log.events if isinstance(e, Restored)),
                    "first step": next(e for e in log.events if isinstance(e, Progress)),
                }
                for stage, event in first.items():
                    got[stage].append(1000 * (event.at - t0))
                restored = first["restored"]
                assert isinstance(restored, Restored)
                got["entry point's set-up"].append(1000 * restored.setup_s)
                log.close()
        finally:
            await stack.stop()
    print(f"{jobs} jobs of 5 steps, one every {every:.1f}s, one trainer; ms after submit")
    for stage, values in got.items():
        values.sort()
        p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
        print(f"  {stage:<22} p50 {statistics.median(values):7.1f}   p99 {p99:7.1f}"
              f"   max {values[-1]:7.1f}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--every", type=float, default=1.0)
    a = ap.parse_args()
    asyncio.run(main(a.jobs, a.every))
