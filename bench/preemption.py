"""Preemption on the real stack: a run of higher priority submitted to a pool whose every
trainer is busy, to its first step; and what the run it took the trainer from lost.

    .venv/bin/python -m bench.preemption [--rounds 5] [--trainers 2]

First the baseline: the same run submitted to an idle pool, to its first step. Then each
round: `--trainers` runs of priority 0 (the character model, a shuffling data loader,
AdamW, a cosine schedule) train on as many trainers; then a run of priority 10 is
submitted. Timed from just before its submission to its first reported step, on this one
host's clock; the victim's checkpoint (its last step reported before it stopped to the
commit of the step it stopped at) is reported beside it, and its steps lost: the steps its
next attempt computed again (`goodput.steps_redone`), which a preemption must keep at 0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from nats.aio.client import Client

from shared.contracts import JobSpec
from shared.contracts.events import CheckpointCommitted, Preempted, Progress
from shared.history.goodput import goodput
from tests.e2e.jobs import finished, history, job, submit
from tests.support.stack import Stack, eventually

POOLS = """
[pools.default]
min_run_s = 0
max_priority = 10
"""


def charlm(key: str, total: int, pace: float, priority: int = 0) -> JobSpec:
    return job(
        name="charlm", entry_point="examples.charlm:train", total_steps=total, seed=7,
        checkpoint={"every_steps": 50}, config={"pace": pace, "hidden": 32, "embed": 16},
        idempotency_key=key, priority=priority,
    )  # fmt: skip


async def idle(stack: Stack, n: int) -> float:
    """The baseline: the same run submitted to an idle pool, to its first step."""
    nc = await stack.client()
    asked = time.time()
    run_id = await submit(nc, charlm(f"idle{n}", 50, 0.0, priority=10))
    first = await eventually(lambda: _first(nc, run_id), 120, "its first step")
    await finished(nc, run_id, 120)
    return first.at - asked


async def _first(nc: Client, run_id: str) -> Progress | None:
    steps = [e for e in await history(nc, run_id) if isinstance(e, Progress)]
    return steps[0] if steps else None


async def one(stack: Stack, n: int, trainers: int) -> tuple[float, float, int]:
    nc = await stack.client()
    victims = [await submit(nc, charlm(f"v{n}-{i}", 600, 0.03)) for i in range(trainers)]

    async def training() -> bool:
        for run_id in victims:
            steps = [e.step for e in await history(nc, run_id) if isinstance(e, Progress)]
            if not steps or max(steps) < 40:
                return False
        return True

    await eventually(training, 120, "every trainer busy")
    asked = time.time()
    urgent = await submit(nc, charlm(f"u{n}", 50, 0.0, priority=10))

    first = await eventually(lambda: _first(nc, urgent), 120, "the urgent run's first step")
    took = first.at - asked
    victim, pre = "", None
    for run_id in victims:
        found = [e for e in await history(nc, run_id) if isinstance(e, Preempted) and e.by]
        if found:
            victim, pre = run_id, found[0]
    assert pre is not None, "no run made room"
    events = await history(nc, victim)
    commit = next(e for e in events if isinstance(e, CheckpointCommitted) and e.step == pre.step)
    before = max(e.at for e in events if isinstance(e, Progress) and e.at <= commit.at)
    for run_id in [urgent, *victims]:
        await finished(nc, run_id, 300)
    spent = goodput(await history(nc, victim))
    assert spent is not None
    return took, commit.at - before, spent.steps_redone


async def main(rounds: int, trainers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pools = Path(tmp, "pools.toml")
        pools.write_text(POOLS)
        stack = Stack(
            Path(tmp, "stack"), trainers=trainers, env={"BATON_POOLS_FILE": str(pools)}
        )
        await stack.start()
        try:
            baseline = [await idle(stack, n) for n in range(rounds)]
            results = [await one(stack, n, trainers) for n in range(rounds)]
        finally:
            await stack.stop()
    took = [r[0] for r in results]
    ckpt = [r[1] for r in results]
    print(f"preemption, {trainers} busy trainers, {rounds} rounds")
    print(f"  submit -> the urgent run's first step: median {statistics.median(took):.2f}s, "
          f"max {max(took):.2f}s")  # fmt: skip
    print(f"  the victim's checkpoint (within that): median {statistics.median(ckpt):.2f}s")
    idle_s = statistics.median(baseline)
    print(f"  baseline, the same run on an idle pool: median {idle_s:.2f}s; preempting costs "
          f"{statistics.median(took) - idle_s:+.2f}s ({statistics.median(took) / idle_s:.2f}x)")
    print(f"  the victim's steps lost: {[r[2] for r in results]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trainers", type=int, default=2)
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.trainers))
