"""Goodput under a fault schedule on the real stack: one long paced job, a checkpoint every
`--checkpoint-every` seconds, and a SIGKILL of the trainer holding it every `--kill-every`
seconds on average; its trainers restarted by their supervisor, as under `baton up`. Prints
where the run's wall time went (`shared.history.goodput`).

The kills come at random, each between half and one and a half of `--kill-every` after the
last (seeded, so runs compare): kills at a fixed period would land at the same phase of the
checkpoint interval every time, since each attempt's checkpoint clock starts when it does,
and so measure one fixed loss instead of the average one.

    .venv/bin/python -m bench.goodput                       # 10 minutes, a kill a minute
    .venv/bin/python -m bench.goodput --minutes 2 --kill-every 30   # a short look

Times come from event timestamps taken on this one host.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import tempfile
import time
from pathlib import Path

from shared.contracts.events import Started
from shared.history.goodput import goodput
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack

PACE_S = 0.05
"""Seconds a step sleeps; the step's own compute adds a few milliseconds."""


async def main(minutes: float, kill_every: float, checkpoint_every: float, ttl: int) -> None:
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=0, lease_ttl=ttl)
        await stack.start(("dispatcher", "checkpointer", "reaper"))
        for trainer in ("t1", "t2"):
            await stack.add_trainer(trainer, restart=True)
        try:
            nc = await stack.client()
            steps = int(minutes * 60 / (PACE_S + 0.004))
            spec = job(
                entry_point="tests.support.workloads:paced", total_steps=steps,
                checkpoint={"every_seconds": checkpoint_every}, config={"pace": PACE_S},
            )  # fmt: skip
            run_id = await submit(nc, spec)
            log = EventLog(nc, run_id)
            kills, draw = 0, random.Random(7)
            while True:
                try:
                    await finished(nc, run_id, timeout=kill_every * draw.uniform(0.5, 1.5))
                    break
                except AssertionError:  # not over yet: kill whoever holds it
                    holder = [e for e in log.events if isinstance(e, Started)][-1].worker
                    stack.signal(holder, signal.SIGKILL)
                    kills += 1
                    print(f"{time.strftime('%H:%M:%S')} SIGKILL {holder} (#{kills})", flush=True)
            log.close()
            spent = goodput(await history(nc, run_id))
            assert spent is not None
        finally:
            await stack.stop()
    print(
        f"{steps} steps, {kills} kills, lease TTL {ttl}s, a checkpoint every "
        f"{checkpoint_every:.0f}s; {spent.attempts} attempts, {spent.steps_redone} steps redone"
    )
    for category, seconds in spent.seconds().items():
        print(f"  {category:<11} {seconds:8.2f}s  {100 * seconds / spent.wall_s:5.1f}%")
    print(f"goodput {100 * spent.goodput:.1f}% of {spent.wall_s:.1f}s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the job unharmed")
    ap.add_argument("--kill-every", type=float, default=60.0)
    ap.add_argument("--checkpoint-every", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=10)
    a = ap.parse_args()
    asyncio.run(main(a.minutes, a.kill_every, a.checkpoint_every, a.ttl))
