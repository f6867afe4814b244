"""Dispatch rate on the real stack (nats-server and the dispatcher as processes): one client
publishes `--n` valid submissions with `--in-flight` JetStream publishes outstanding, and the
bench times (a) the publishes' acks and (b) end to end, the first publish to the `accepted`
event of the last submission (the dispatcher emits it after the run's record and task are
stored). Each round runs the dispatcher one submission at a time
(`BATON_DISPATCH_CONCURRENCY=1`, the baseline: how it worked before) and as configured by
default, on fresh stacks, so the ratio is measured in the same run.

    .venv/bin/python -m bench.dispatch [--n 2000] [--in-flight 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from shared.bus import names
from shared.config import Settings
from shared.contracts import encode
from tests.e2e.jobs import job
from tests.support.stack import Stack


async def one(n: int, in_flight: int, env: dict[str, str]) -> tuple[float, float]:
    """(publish-ack rate, end-to-end rate), submissions per second."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=0, env=env)
        await stack.start(("dispatcher",))
        try:
            nc = await stack.client()
            js = nc.jetstream()
            accepted = 0
            done = asyncio.Event()

            async def count(_: object) -> None:
                nonlocal accepted
                accepted += 1
                if accepted == n:
                    done.set()

            await nc.subscribe(names.event_subject("*", "accepted"), cb=count)
            specs = [encode(job(total_steps=10, idempotency_key=f"b{i}")) for i in range(n)]
            gate = asyncio.Semaphore(in_flight)

            async def submit(payload: bytes, i: int) -> None:
                async with gate:
                    await js.publish(
                        names.submit_subject("default"), payload, headers={"Nats-Msg-Id": f"b{i}"}
                    )

            t0 = time.perf_counter()
            await asyncio.gather(*(submit(p, i) for i, p in enumerate(specs)))
            acked = time.perf_counter() - t0
            await asyncio.wait_for(done.wait(), 600)
            end_to_end = time.perf_counter() - t0
        finally:
            await stack.stop()
    return n / acked, n / end_to_end


async def main(n: int, in_flight: int, rounds: int) -> None:
    default = Settings().dispatch_concurrency
    cases = {"one at a time (before)": {"BATON_DISPATCH_CONCURRENCY": "1"},
             f"concurrency {default} (default)": {}}  # fmt: skip
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, env in cases.items():
            got[name].append(await one(n, in_flight, {"BATON_LOG_LEVEL": "INFO", **env}))
    print(f"{n} submissions, {in_flight} in flight, {rounds} rounds (medians)")
    medians = {}
    for name, results in got.items():
        acks = statistics.median(r[0] for r in results)
        e2e = statistics.median(r[1] for r in results)
        medians[name] = e2e
        runs = ", ".join(f"{r[1]:.0f}" for r in results)
        print(f"{name:<28} publish acks {acks:8.0f}/s   dispatched {e2e:6.0f}/s  ({runs})")
    before, after = medians.values()
    print(f"ratio {after / before:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.in_flight, a.rounds))
