"""Recovery time on the real stack (nats-server, services as processes, the lease TTL and
pulse `baton up` gives), signal -> first resumed step:

    SIGKILL, supervised   the trainer process killed, restarted by its supervisor as under
                          `baton up`: its successor hands the run over at once, unless the
                          reaper heard the silence first
    SIGKILL, unsupervised the trainer killed and not restarted: its pulse stops, and the
                          reaper hands the run over after `BATON_SILENT_AFTER`
    silent host           the trainer and its training processes stopped (SIGSTOP), their
                          TCP connections open, as when a host hangs or its cable is pulled:
                          the same pulse decides
    SIGTERM               preemption: checkpoint, release, nak
    torchrun              the baseline: the same job as a torchrun worker script
                          (bench/paced_torchrun.py: `torch.save` every 20 steps, resumed
                          from the newest), its worker SIGKILLed at step 50 and restarted
                          by torchrun's agent (`--max-restarts 1`)

    .venv/bin/python -m bench.recovery [--rounds 2] [--hub-nodes 3] [--silent-after 0]

`--hub-nodes 3` runs the three-node hub with its 30 s lease TTL; `--silent-after 0` turns
the pulse's watch off (the lease TTL alone decides, as before it). Times come from event
timestamps taken on this one host, so no clocks are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from baton.stack.options import CLUSTER_LEASE_TTL
from bench import torchrun
from bench.torchrun import REPO
from shared.config import Settings
from shared.contracts.events import HandedOver, Progress, Started
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import Stack, children_of

SILENT = -1
"""Not a signal: SIGSTOP of the trainer and all its processes."""


def stop_family(pid: int) -> list[int]:
    family = [pid, *children_of(pid)]
    for p in family:
        os.kill(p, signal.SIGSTOP)
    return family


async def one(stack: Stack, sig: int, key: str) -> tuple[float, str]:
    nc = await stack.client()
    spec = job(
        entry_point="tests.support.workloads:paced",
        total_steps=TOTAL,
        idempotency_key=key,
        checkpoint={"every_steps": EVERY},
        config={"pace": PACE},
    )
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 60, "start")
    assert isinstance(first, Started)
    await log.wait_for(
        lambda e: isinstance(e, Progress) and e.step >= KILL_AT, 60, f"step {KILL_AT}"
    )
    stopped: list[int] = []
    at_signal = time.time()
    if sig == SILENT:
        stopped = stop_family(stack.pid(first.worker))
    else:
        stack.signal(first.worker, sig)
    try:
        again = await log.wait_for(
            lambda e: isinstance(e, Started) and e.token > first.token, 120, "the next attempt"
        )
        assert isinstance(again, Started)
        resumed = await log.wait_for(
            lambda e: isinstance(e, Progress) and e.worker == again.worker and e.at >= again.at,
            120,
            "its first step",
        )
    finally:
        for p in stopped:  # it wakes up fenced, and stops its attempt
            os.kill(p, signal.SIGCONT)
    await finished(nc, run_id, timeout=120)
    handed = [e for e in log.of(HandedOver) if e.token == first.token]
    log.close()
    how = handed[0].reason if handed else "released (no hand-over)"
    return resumed.at - at_signal, how


TORCHRUN = "torchrun, worker SIGKILL"
TOTAL, EVERY, KILL_AT, PACE = 400, 20, 50, 0.02


def torchrun_kill() -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        args = ["--dir", tmp, "--steps", str(TOTAL), "--every", str(EVERY), "--pace", str(PACE)]
        return torchrun.kill_worker(REPO / "bench" / "paced_torchrun.py", args, KILL_AT, TOTAL)


async def main(rounds: int, hub_nodes: int, silent_after: str | None) -> None:
    cases = (
        ("SIGKILL, supervised", signal.SIGKILL, True),
        ("SIGKILL, unsupervised", signal.SIGKILL, False),
        ("silent host (SIGSTOP)", SILENT, False),
        ("SIGTERM", signal.SIGTERM, False),
    )
    ttl = CLUSTER_LEASE_TTL if hub_nodes > 1 else Settings().lease_ttl_s
    env = {"BATON_SILENT_AFTER": silent_after} if silent_after is not None else {}
    results: dict[str, list[float]] = {name: [] for name, _, _ in cases} | {TORCHRUN: []}
    reasons: dict[str, set[str]] = {name: set() for name in results}
    for r in range(rounds):
        for name, sig, supervised in cases:
            with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
                stack = Stack(
                    Path(tmp) / "s", trainers=0, lease_ttl=ttl, hub_nodes=hub_nodes, env=env
                )
                try:
                    await stack.start(("dispatcher", "checkpointer", "reaper"))
                    for trainer in ("t1", "t2"):
                        await stack.add_trainer(trainer, restart=supervised)
                    key = f"{name.replace(' ', '').replace(',', '-')}-{r}"[:40]
                    took, how = await one(stack, sig, "".join(c for c in key if c.isalnum()))
                    results[name].append(took)
                    reasons[name].add(how.split(":")[0].split(" (")[0][:60])
                finally:
                    await stack.stop()
        torchrun_phases = await asyncio.to_thread(torchrun_kill)
        results[TORCHRUN].append(torchrun_phases["total"])
        reasons[TORCHRUN].add(f"resumed at step {torchrun_phases['resumed at step']:.0f}")
    ack_wait = Settings(lease_ttl_s=ttl).ack_wait_s
    watch = silent_after if silent_after is not None else str(Settings().silent_after_s)
    print(
        f"hub nodes {hub_nodes}, lease TTL {ttl}s (task AckWait {ack_wait:.0f}s),"
        f" BATON_SILENT_AFTER {watch}s"
    )
    base = statistics.median(results[TORCHRUN])
    for name, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(
            f"{name} -> first resumed step: median {median:.2f}s (runs: {runs});"
            f" ratio to torchrun {median / base:.2f}, to TTL {median / ttl:.2f};"
            f" by: {'; '.join(sorted(reasons[name]))}"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hub-nodes", type=int, default=1)
    ap.add_argument("--silent-after", default=None, help="BATON_SILENT_AFTER; 0: watch off")
    a = ap.parse_args()
    asyncio.run(main(a.rounds, a.hub_nodes, a.silent_after))
