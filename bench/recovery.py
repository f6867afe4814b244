"""Recovery time at the default lease TTL on the real stack (nats-server, services as
processes), signal -> first resumed step:

    SIGKILL, supervised   the trainer process killed, restarted by its supervisor as under
                          `baton up`: its successor hands the run over at once
    SIGKILL, unsupervised the trainer killed and not restarted (a host gone): the reaper
                          hands the run over when its lease expires
    SIGTERM               preemption: checkpoint, release, nak

    .venv/bin/python -m bench.recovery [--ttl 10] [--rounds 2]

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

from shared.config import Settings
from shared.contracts.events import Progress, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack


async def one(stack: Stack, sig: int, key: str) -> float:
    nc = await stack.client()
    spec = job(
        entry_point="tests.support.workloads:paced",
        total_steps=400,
        idempotency_key=key,
        checkpoint={"every_steps": 20},
        config={"pace": 0.02},
    )
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "start")
    assert isinstance(first, Started)
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 50, 60, "step 50")
    at_signal = time.time()
    stack.signal(first.worker, sig)
    again = await log.wait_for(
        lambda e: isinstance(e, Started) and e.token > first.token, 120, "the next attempt"
    )
    assert isinstance(again, Started)
    resumed = await log.wait_for(
        lambda e: isinstance(e, Progress) and e.worker == again.worker and e.at >= again.at,
        120,
        "its first step",
    )
    await finished(nc, run_id, timeout=120)
    log.close()
    return resumed.at - at_signal


async def main(ttl: int, rounds: int) -> None:
    cases = (
        ("SIGKILL, supervised", signal.SIGKILL, True),
        ("SIGKILL, unsupervised", signal.SIGKILL, False),
        ("SIGTERM", signal.SIGTERM, False),
    )
    results: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for r in range(rounds):
        for name, sig, supervised in cases:
            with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
                stack = Stack(Path(tmp) / "s", trainers=0, lease_ttl=ttl)
                await stack.start(("dispatcher", "checkpointer", "reaper"))
                for trainer in ("t1", "t2"):
                    await stack.add_trainer(trainer, restart=supervised)
                try:
                    key = f"{name.replace(' ', '').replace(',', '-')}-{r}"
                    results[name].append(await one(stack, sig, key))
                finally:
                    await stack.stop()
    ack_wait = Settings(lease_ttl_s=ttl).ack_wait_s
    print(f"lease TTL {ttl}s (task AckWait {ack_wait:.0f}s)")
    for name, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(
            f"{name} -> first resumed step: median {median:.2f}s (runs: {runs});"
            f" ratio to TTL {median / ttl:.2f}, to AckWait {median / ack_wait:.2f}"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ttl", type=int, default=Settings().lease_ttl_s)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    asyncio.run(main(a.ttl, a.rounds))
