"""What syncing every write costs the hub: dispatch and lease renewals with the single
node's `sync_interval: always` (`baton up`'s default) against the server's own default
(an fsync every 2 min), on fresh stacks, in the same run.

* dispatch: `bench.dispatch`'s measure — `--n` submissions, `--in-flight` publishes
  outstanding, timed to the `accepted` of the last (its record and task stored);
* renewals: `--leases` leases held at once, each renewed back to back for `--seconds` by
  compare-and-swap (`shared.state.lease.Lease.renew`, as a trainer's keeper does every third
  of the TTL): renewals per second, and the time one renewal takes (p50, p99).

    .venv/bin/python -m bench.sync [--n 1000] [--in-flight 256] [--leases 64] [--seconds 10]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.dispatch import one as dispatch_rate
from shared.state.lease import Lease
from tests.support.stack import Stack

CASES = {"server default (2 min)": "default", "always (baton up's default)": "always"}


@contextlib.contextmanager
def syncing(mode: str) -> Iterator[None]:
    """Stacks started inside it run their server with `sync_interval` `mode`."""
    before = os.environ.get("BATON_NATS_SYNC")
    os.environ["BATON_NATS_SYNC"] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("BATON_NATS_SYNC", None)
        else:
            os.environ["BATON_NATS_SYNC"] = before


async def renewals(leases: int, seconds: float) -> tuple[float, float, float]:
    """(renewals per second, p50 ms, p99 ms) of `leases` leases renewed back to back."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        stack = Stack(Path(tmp) / "s", trainers=0, env={"BATON_LOG_LEVEL": "INFO"})
        await stack.start(("dispatcher",))  # declares the buckets
        try:
            js = (await stack.client()).jetstream()
            held = [Lease(js, f"bench-{i}", "bench", 30) for i in range(leases)]
            for lease in held:
                assert await lease.acquire(), lease.run_id
            times: list[float] = []
            end = time.perf_counter() + seconds

            async def keep(lease: Lease) -> None:
                while (t0 := time.perf_counter()) < end:
                    assert await lease.renew(), lease.run_id
                    times.append(time.perf_counter() - t0)

            await asyncio.gather(*(keep(lease) for lease in held))
        finally:
            await stack.stop()
    times.sort()
    return len(times) / seconds, 1000 * times[len(times) // 2], 1000 * times[len(times) * 99 // 100]


async def main(n: int, in_flight: int, leases: int, seconds: float, rounds: int) -> None:
    dispatched: dict[str, list[float]] = {name: [] for name in CASES}
    renewed: dict[str, list[tuple[float, float, float]]] = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, mode in CASES.items():
            with syncing(mode):
                dispatched[name].append((await dispatch_rate(n, in_flight, {}))[1])
                renewed[name].append(await renewals(leases, seconds))
    print(f"{rounds} rounds (medians); dispatch: {n} submissions, {in_flight} in flight; "
          f"renewals: {leases} leases for {seconds:.0f}s")  # fmt: skip
    base: tuple[float, float] | None = None
    for name in CASES:
        d = statistics.median(dispatched[name])
        r = statistics.median(x[0] for x in renewed[name])
        p50 = statistics.median(x[1] for x in renewed[name])
        p99 = statistics.median(x[2] for x in renewed[name])
        base = base or (d, r)
        print(f"{name:<28} dispatched {d:6.0f}/s ({d / base[0]:.2f}x)   renewals {r:6.0f}/s "
              f"({r / base[1]:.2f}x), one renewal p50 {p50:.1f} ms p99 {p99:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--leases", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.in_flight, a.leases, a.seconds, a.rounds))
