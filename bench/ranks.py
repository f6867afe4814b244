"""Runs of several ranks on the real stack (nats-server, services as processes, gloo on CPU):

    recovery   a rank's trainer SIGKILLed -> the first step of the re-formed group, as a
               ratio to the lease TTL: rank 1 (noticed by its key's silence), rank 0 with
               its supervisor restarting it (its successor hands the run over), and rank 0
               gone for good (the lease lapses)
    shrink     an elastic run (ranks 1 to 2, `examples/elastic.py`) on two trainers: rank 1's
               SIGKILLed, no spare -> the first step at one rank
    stall      the training loop's stall per checkpoint at 2 ranks vs 1 (rank 0's: it writes
               the replicated state; the others write only their own), same model, same run

    .venv/bin/python -m bench.ranks [--ttl 10] [--rounds 2] [--hidden 1024]

Times come from event timestamps taken on this one host, so no clocks are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.contracts import JobSpec
from shared.contracts.events import CheckpointCommitted, GroupFormed, Progress
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack


def ddp(key: str, ranks: int, total: int, **config: Any) -> JobSpec:
    return job(
        name="bench-ranks",
        entry_point="examples.ddp:train",
        total_steps=total,
        ranks=ranks,
        seed=5,
        checkpoint={"every_steps": 10},
        config=config,
        idempotency_key=key,
    )


def elastic(key: str) -> JobSpec:
    return job(
        name="bench-elastic", entry_point="examples.elastic:train", total_steps=600,
        ranks={"min": 1, "max": 2}, seed=5, checkpoint={"every_steps": 10},
        config={"steps_sleep": 0.02}, idempotency_key=key,
    )  # fmt: skip


async def recovery(stack: Stack, rank: int, key: str, spec: JobSpec | None = None) -> float:
    """Seconds from SIGKILL of `rank`'s trainer to the re-formed group's first step."""
    nc = await stack.client()
    run_id = await submit(nc, spec or ddp(key, 2, 600, steps_sleep=0.02))
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, GroupFormed), 60, "the group")
    assert isinstance(first, GroupFormed)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 40, 60, "step 40")
    killed_at = time.time()
    stack.signal(first.members[rank], signal.SIGKILL)
    again = await log.wait_for(
        lambda e: isinstance(e, GroupFormed) and e.epoch > first.epoch, 120, "a new group"
    )
    assert isinstance(again, GroupFormed)
    step = await log.wait_for(
        lambda e: isinstance(e, Progress) and e.at >= again.at and e.worker == again.members[0],
        120,
        "its first step",
    )
    await finished(nc, run_id, timeout=300)
    log.close()
    return step.at - killed_at


async def stall(stack: Stack, ranks: int, key: str, hidden: int) -> float:
    """Rank 0's stall per checkpoint, in seconds."""
    nc = await stack.client()
    run_id = await submit(nc, ddp(key, ranks, 100, hidden=hidden, dim=256))
    log = EventLog(nc, run_id)
    await finished(nc, run_id, timeout=300)
    progress = [e for e in log.of(Progress) if e.worker]
    commits = [e for e in log.of(CheckpointCommitted) if not e.final]
    log.close()
    return max(p.stall_s for p in progress) / max(1, len(commits))


async def with_stack(ttl: int, supervised: bool, body: Any, trainers: int = 3) -> Any:
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=0, lease_ttl=ttl)
        await stack.start(("dispatcher", "checkpointer", "reaper"))
        try:
            for name in ("t1", "t2", "t3")[:trainers]:
                await stack.add_trainer(name, restart=supervised)
            await stack.ready(("trainer",))
            return await body(stack)
        finally:
            await stack.stop()


async def main(ttl: int, rounds: int, hidden: int) -> None:
    cases = (
        ("rank 1 SIGKILL (not restarted)", 1, False),
        ("rank 0 SIGKILL, supervised", 0, True),
        ("rank 0 SIGKILL (not restarted)", 0, False),
    )
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(rounds):
        for name, rank, supervised in cases:
            key = f"rec-{rank}-{supervised}-{r}"

            async def one(s: Stack, rank: int = rank, key: str = key) -> float:
                return await recovery(s, rank, key)

            times[name].append(await with_stack(ttl, supervised, one))
        shrink = "elastic 1-2, rank 1 SIGKILL, no spare -> 1 rank"
        times.setdefault(shrink, [])

        async def shrunk(s: Stack, key: str = f"shrink-{r}") -> float:
            return await recovery(s, 1, key, elastic(key))

        times[shrink].append(await with_stack(ttl, False, shrunk, trainers=2))
    print(f"lease TTL {ttl}s")
    for name, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name} -> first step of the re-formed group: median {median:.2f}s "
              f"(runs: {runs}); ratio to TTL {median / ttl:.2f}")  # fmt: skip

    async def stalls(s: Stack) -> tuple[list[float], list[float]]:
        one, two = [], []
        for r in range(rounds):  # interleaved, so drift on the machine hits both alike
            one.append(await stall(s, 1, f"stall-1-{r}", hidden))
            two.append(await stall(s, 2, f"stall-2-{r}", hidden))
        return one, two

    one, two = await with_stack(ttl, False, stalls)
    m1, m2 = statistics.median(one), statistics.median(two)
    print(f"checkpoint stall per checkpoint (rank 0, hidden {hidden}): 1 rank {m1 * 1e3:.1f} ms, "
          f"2 ranks {m2 * 1e3:.1f} ms; ratio 2/1 {m2 / m1:.2f}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttl", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args()
    asyncio.run(main(a.ttl, a.rounds, a.hidden))
