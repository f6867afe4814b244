"""Goodput under a fault schedule on the real stack: one long paced job, a checkpoint every
`--checkpoint-every` seconds, and a SIGKILL of the trainer holding it every `--kill-every`
seconds on average; its trainers restarted by their supervisor, as under `baton up`. Prints
where the run's wall time went (`shared.history.goodput`), first with checkpoints alone (the
baseline), then with a local snapshot every `--local-every` seconds (`baton.runtime.local`),
under the same kills.

The kills come at random, each between half and one and a half of `--kill-every` after the
last (seeded, so runs compare): kills at a fixed period would land at the same phase of the
checkpoint interval every time, since each attempt's checkpoint clock starts when it does,
and so measure one fixed loss instead of the average one.

    .venv/bin/python -m bench.goodput                  # 2 x 10 minutes, a kill a minute
    .venv/bin/python -m bench.goodput --minutes 2 --kill-every 30 --no-baseline  # a look

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
from shared.history.goodput import Goodput, goodput
from tests.e2e.jobs import EventLog, finished, history, job, submit
from tests.support.stack import Stack

PACE_S = 0.05
"""Seconds a step sleeps; the step's own compute adds a few milliseconds."""


async def measure(
    minutes: float, kill_every: float, checkpoint_every: float, ttl: int, local: float | None
) -> tuple[Goodput, int, int]:
    """One run under the fault schedule: where its time went, its steps, the kills."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=0, lease_ttl=ttl)
        await stack.start(("dispatcher", "checkpointer", "reaper"))
        for trainer in ("t1", "t2"):
            await stack.add_trainer(trainer, restart=True)
        try:
            nc = await stack.client()
            steps = int(minutes * 60 / (PACE_S + 0.004))
            policy = {"every_steps": None, "every_seconds": checkpoint_every,
                      "local_every_seconds": local}  # fmt: skip
            spec = job(
                entry_point="tests.support.workloads:paced", total_steps=steps,
                checkpoint=policy, config={"pace": PACE_S},
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
    return spent, steps, kills


def show(title: str, spent: Goodput, steps: int, kills: int) -> None:
    print(f"{title}: {steps} steps, {kills} kills; {spent.attempts} attempts, "
          f"{spent.steps_redone} steps redone")  # fmt: skip
    for category, seconds in spent.seconds().items():
        print(f"  {category:<11} {seconds:8.2f}s  {100 * seconds / spent.wall_s:5.1f}%")
    print(f"  goodput {100 * spent.goodput:.1f}% of {spent.wall_s:.1f}s")


async def main(
    minutes: float, kill_every: float, checkpoint_every: float, ttl: int, local: float,
    baseline: bool,
) -> None:  # fmt: skip
    print(f"a checkpoint every {checkpoint_every:.0f}s, a kill every {kill_every:.0f}s on "
          f"average, lease TTL {ttl}s")  # fmt: skip
    results = []
    if baseline:
        results.append(("checkpoints alone", *await measure(
            minutes, kill_every, checkpoint_every, ttl, None)))  # fmt: skip
    results.append((f"with a local snapshot every {local:g}s", *await measure(
        minutes, kill_every, checkpoint_every, ttl, local)))  # fmt: skip
    for title, spent, steps, kills in results:
        show(title, spent, steps, kills)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the job unharmed")
    ap.add_argument("--kill-every", type=float, default=60.0)
    ap.add_argument("--checkpoint-every", type=float, default=10.0)
    ap.add_argument("--local-every", type=float, default=0.5,
                    help="seconds between local snapshots (0: after every step)")  # fmt: skip
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the run with checkpoints alone")  # fmt: skip
    ap.add_argument("--ttl", type=int, default=10)
    a = ap.parse_args()
    asyncio.run(main(a.minutes, a.kill_every, a.checkpoint_every, a.ttl, a.local_every,
                     not a.no_baseline))  # fmt: skip
