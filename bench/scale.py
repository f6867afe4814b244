"""The control plane under many trainers, and the reaper's sweep under a long history.

    .venv/bin/python -m bench.scale [--trainers 1000,5000,10000] [--hub-nodes 1,3]
                                    [--seconds 30] [--ttl 10] [--procs 2] [--pulse 0.5]
                                    [--pulses-only]
                                    [--history 0,10000,100000] [--live 100]

**Trainers.** A real hub — one nats-server, or a cluster of three with every stream and
bucket on all three (`ensure(js, replicas=3)`), as `baton up --hub-nodes 3` runs it — and
simulated
trainers doing what a real one does to the control plane, spread over `--procs` client
processes (a few connections each): each holds a task message un-acked and a lease, and
every third of the TTL touches the message (`in_progress`), renews the lease (a CAS
publish with TTL) and reads its run record; every `BATON_HEARTBEAT` (2 s) it writes its
registry heartbeat; every `--pulse` seconds (0.5, `BATON_PULSE`) its pulse, which a
process running the reaper's silence watch hears (its CPU, and any trainer it judged
silent, are reported). The trainers' connections are spread over the hub's nodes, as
clients given every URL spread themselves. Reported per hub and fleet size: renewal latency
p50/p99, failed renewals, how late the clients' timers fired (when the clients themselves
are the bottleneck, this says so), and the servers' CPU (cores, from /varz, summed over the
nodes) and resident memory (summed).

**Sweep.** `--live` running runs in the live index, plus N ended runs retired the way the
reaper retires them (archived; their records kept in the runs bucket, as during
`BATON_RETAIN_ENDED`). Timed: what a sweep reads (`Runs.live()`, the live index and those
runs' records) against reading every key of the runs bucket, what it read before the live
index — the baseline, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from baton.stack.cluster import HubCluster
from baton.stack.natsconf import ClusterRoutes
from baton.stack.natsserver import NatsServer
from services.reaper.silences import Heard, Silences
from shared.bus import names
from shared.bus.connect import connect, publish
from shared.bus.streams import ensure
from shared.config import Settings
from shared.contracts import RunRecord, RunState, encode
from shared.contracts.control import Pulse
from shared.state import archive
from shared.state.lease import Lease
from shared.state.runs import Runs
from tests.e2e.jobs import job

HEARTBEAT_S = 2.0
CONNS_PER_PROC = 4


def record(run_id: str, state: RunState = RunState.RUNNING) -> RunRecord:
    now = time.time()
    return RunRecord(
        run_id=run_id, spec=job(), spec_hash="scale", state=state, created_at=now, updated_at=now
    )


# -- one client process ------------------------------------------------------------------


async def worker(
    url: str, proc: int, count: int, seconds: float, ttl: int, pulse_s: float
) -> dict[str, Any]:
    # One node per connection in turn: clients given every URL pick one at random each.
    urls = url.split(",")
    clients = [
        await connect(urls[(proc + i) % len(urls)], f"scale-{proc}-{i}")
        for i in range(CONNS_PER_PROC)
    ]
    pool = f"scale{proc}"
    js0 = clients[0].jetstream()
    await js0.add_consumer(
        names.TASKS_STREAM,
        ConsumerConfig(
            durable_name=pool, filter_subject=names.task_subject(pool, "*"),
            ack_policy=AckPolicy.EXPLICIT, ack_wait=3600, max_ack_pending=count + 10,
        ),
    )  # fmt: skip
    ids = [f"p{proc}t{i}" for i in range(count)]
    sem = asyncio.Semaphore(256)

    async def setup(i: int, run_id: str) -> Lease:
        js = clients[i % CONNS_PER_PROC].jetstream()
        async with sem:
            await publish(js, names.task_subject(pool, run_id), b"task", msg_id=run_id)
            runs = await Runs.open(js)
            await runs.create(record(run_id))
            lease = Lease(js, run_id, f"w-{run_id}", ttl)
            assert await lease.acquire()
            return lease

    leases = await asyncio.gather(*(setup(i, r) for i, r in enumerate(ids)))
    sub = await js0.pull_subscribe_bind(pool, stream=names.TASKS_STREAM)
    tasks: list[Msg] = []
    while len(tasks) < count:
        tasks += await sub.fetch(min(256, count - len(tasks)), timeout=10)
    print(json.dumps({"ready": proc}), flush=True)
    # Start together: the parent says go on stdin once every process is ready.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    renew_ms: list[float] = []
    late_ms: list[float] = []
    failed = errors = 0
    interval = ttl / 3
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def trainer(i: int) -> None:
        nonlocal failed, errors
        js = clients[i % CONNS_PER_PROC].jetstream()
        runs = await Runs.open(js)
        lease, task = leases[i], tasks[i]
        next_beat = loop.time() + random.uniform(0, HEARTBEAT_S)
        due = loop.time() + random.uniform(0, interval)
        while True:
            now = loop.time()
            if next_beat <= due:
                await asyncio.sleep(max(0.0, next_beat - now))
                late_ms.append((loop.time() - next_beat) * 1000)
                next_beat += HEARTBEAT_S
                with _counted():
                    await publish(
                        js, names.heartbeat_subject(lease.worker, ""), b"{}",
                        msg_id=f"hb.{lease.worker}.{next_beat}",
                        headers={"Nats-TTL": f"{int(HEARTBEAT_S * 3)}s"}, attempts=1,
                    )  # fmt: skip
                continue
            await asyncio.sleep(max(0.0, due - now))
            if loop.time() > end:
                return
            late_ms.append((loop.time() - due) * 1000)
            due += interval
            try:
                await task.in_progress()
                t0 = time.perf_counter()
                ok = await lease.renew()
                renew_ms.append((time.perf_counter() - t0) * 1000)
                failed += not ok
                await runs.get(lease.run_id)
            except Exception:
                errors += 1

    pulses = [
        pulse(clients[i % CONNS_PER_PROC], leases[i], pulse_s, end) for i in range(count)
    ] if pulse_s else []  # fmt: skip
    await asyncio.gather(*(trainer(i) for i in range(count)), *pulses)
    for nc in clients:
        await nc.close()
    return {"renew_ms": renew_ms, "late_ms": late_ms, "failed": failed, "errors": errors}


async def pulse(nc: Client, lease: Lease, every_s: float, end: float) -> None:
    """What `services/trainer/pulse.py` sends while its trainer holds the run."""
    loop = asyncio.get_running_loop()
    body = encode(Pulse(worker=lease.worker, run_id=lease.run_id, token=lease.token))
    await asyncio.sleep(random.uniform(0, every_s))
    while loop.time() < end:
        await nc.publish(names.pulse_subject(lease.worker), body)
        await asyncio.sleep(every_s)


class _counted:
    """Heartbeats are advisory: one that fails is skipped, as the trainer does."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)  # type: ignore[arg-type]


# -- the parent ----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def varz(server: NatsServer) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/varz", timeout=5) as r:
        data: dict[str, Any] = json.load(r)
        return data


def spawn(
    url: str, proc: int, count: int, seconds: float, ttl: int, pulse_s: float
) -> subprocess.Popen[str]:
    """A client process of `count` trainers (`proc` -1: the reaper's silence watch); JSON on
    its stdout, "go" on its stdin."""
    argv = [sys.executable, "-m", "bench.scale", "--worker", str(proc), "--url", url]
    argv += ["--count", str(count), "--seconds", str(seconds), "--ttl", str(ttl)]
    argv += ["--pulse", str(pulse_s)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


async def listener(url: str, seconds: float, pulse_s: float) -> dict[str, Any]:
    """The reaper's silence watch (`services/reaper/silences.py`, its own code) hearing every
    pulse: how many it heard, the CPU it spent, and how many trainers it judged silent —
    none of these trainers is, so every one would be a false alarm."""
    nc = await connect(url, "scale-reaper")
    js = nc.jetstream()
    silences = Silences(nc, js, await Runs.open(js), None, Settings(pulse_s=pulse_s))
    judged = 0
    heard = 0

    async def counted(worker: str, h: Heard, reason: str) -> bool:
        nonlocal judged
        judged += 1
        return False  # the bench's records name no delivery: nothing to hand over

    async def on_pulse(msg: Msg) -> None:
        nonlocal heard
        heard += 1
        await hear(msg)

    silences.gone = counted  # type: ignore[method-assign]
    hear = silences._on_pulse
    silences._on_pulse = on_pulse  # type: ignore[method-assign]
    await silences.start()
    print(json.dumps({"ready": -1}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    # The first window after start the watch judges no one: measure after it.
    await asyncio.sleep(Settings().silent_after_s)
    heard, cpu0, t0 = 0, time.process_time(), time.monotonic()
    await asyncio.sleep(seconds - Settings().silent_after_s)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    await silences.stop()
    await nc.close()
    return {"heard_per_s": heard / wall, "cpu_cores": cpu / wall, "judged": judged}


def reap(children: list[subprocess.Popen[str]]) -> None:
    """Stop whichever client processes are still running (a failed measurement)."""
    for c in children:
        if c.poll() is None:
            c.kill()
            c.wait()


def hub(root: Path, nodes: int) -> HubCluster:
    def make(i: int, routes: ClusterRoutes | None) -> NatsServer:
        return NatsServer(
            root / f"hub-{i + 1}", server_name=f"hub-{i + 1}", domain=names.HUB_DOMAIN,
            http_port=0, cluster=routes,
        )  # fmt: skip

    return HubCluster(nodes, make)


async def fleet(
    trainers: int, nodes: int, procs: int, seconds: float, ttl: int, pulse_s: float
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="baton-scale-") as tmp:
        cluster = hub(Path(tmp), nodes)
        await cluster.start()
        try:
            nc = await connect(cluster.url, "scale")
            await ensure(nc.jetstream(), replicas=nodes)
            await nc.close()
            share = [trainers // procs + (p < trainers % procs) for p in range(procs)]
            children = [
                spawn(cluster.url, p, n, seconds, ttl, pulse_s) for p, n in enumerate(share)
            ]
            if pulse_s:
                children.append(spawn(cluster.url, -1, 0, seconds, ttl, pulse_s))
            try:
                for c in children:
                    assert c.stdout is not None
                    await asyncio.to_thread(c.stdout.readline)  # ready
                for c in children:
                    assert c.stdin is not None
                    c.stdin.write("go\n")
                    c.stdin.flush()
                # Read their results as they come (a full pipe would stall them).
                outputs = [asyncio.create_task(asyncio.to_thread(c.communicate)) for c in children]
                cpu, mem = [], []
                # Skip the first interval (the trainers' random offsets), then sample.
                await asyncio.sleep(ttl / 3)
                while not all(o.done() for o in outputs):
                    vs = [await asyncio.to_thread(varz, n) for n in cluster.nodes]
                    cpu.append(sum(float(v["cpu"]) for v in vs) / 100)
                    mem.append(sum(float(v["mem"]) for v in vs))
                    await asyncio.sleep(1)
                results = [json.loads((await o)[0].strip().splitlines()[-1]) for o in outputs]
                heard = results.pop() if pulse_s else {}
            finally:
                reap(children)
        finally:
            await cluster.stop()
    renew = [x for r in results for x in r["renew_ms"]]
    late = [x for r in results for x in r["late_ms"]]
    return {
        "trainers": trainers,
        "nodes": nodes,
        "renewals": len(renew),
        "p50_ms": pct(renew, 0.5),
        "p99_ms": pct(renew, 0.99),
        "failed": sum(r["failed"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "late_p99_ms": pct(late, 0.99),
        "server_cores": statistics.mean(cpu[:-1] or cpu) if cpu else float("nan"),
        "server_mem_mib": max(mem) / 2**20 if mem else float("nan"),
        "pulses": heard,
    }


async def pulser(url: str, proc: int, count: int, seconds: float, pulse_s: float) -> dict[str, Any]:
    """`count` trainers that only pulse (no lease, no heartbeat): the pulse's own cost."""
    urls = url.split(",")
    clients = [
        await connect(urls[(proc + i) % len(urls)], f"pulse-{proc}-{i}")
        for i in range(CONNS_PER_PROC)
    ]
    print(json.dumps({"ready": proc}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    sent = 0

    async def one(i: int) -> None:
        nonlocal sent
        worker = f"w-p{proc}t{i}"
        body = encode(Pulse(worker=worker, run_id=f"p{proc}t{i}", token=1))
        nc = clients[i % CONNS_PER_PROC]
        await asyncio.sleep(random.uniform(0, pulse_s))
        while loop.time() < end:
            await nc.publish(names.pulse_subject(worker), body)
            sent += 1
            await asyncio.sleep(pulse_s)

    await asyncio.gather(*(one(i) for i in range(count)))
    for nc in clients:
        await nc.close()
    return {"sent_per_s": sent / seconds}


async def pulses_only(trainers: int, procs: int, seconds: float, pulse_s: float) -> dict[str, Any]:
    """One node, `trainers` pulsing from `procs` processes, the reaper's watch hearing them:
    the server's and the reaper's CPU for the pulses alone."""
    with tempfile.TemporaryDirectory(prefix="baton-scale-") as tmp:
        cluster = hub(Path(tmp), 1)
        await cluster.start()
        try:
            nc = await connect(cluster.url, "scale")
            await ensure(nc.jetstream())
            await nc.close()
            share = [trainers // procs + (p < trainers % procs) for p in range(procs)]
            children = [
                spawn(cluster.url, -3 - p, n, seconds, 10, pulse_s) for p, n in enumerate(share)
            ]
            children.append(spawn(cluster.url, -1, 0, seconds, 10, pulse_s))
            try:
                for c in children:
                    assert c.stdout is not None
                    await asyncio.to_thread(c.stdout.readline)
                for c in children:
                    assert c.stdin is not None
                    c.stdin.write("go\n")
                    c.stdin.flush()
                outputs = [asyncio.create_task(asyncio.to_thread(c.communicate)) for c in children]
                await asyncio.sleep(Settings().silent_after_s)
                cpu = []
                while not all(o.done() for o in outputs):
                    cpu.append(float(varz(cluster.nodes[0])["cpu"]) / 100)
                    await asyncio.sleep(1)
                results = [json.loads((await o)[0].strip().splitlines()[-1]) for o in outputs]
            finally:
                reap(children)
        finally:
            await cluster.stop()
    heard = results.pop()
    return {
        "sent_per_s": sum(r["sent_per_s"] for r in results),
        "server_cores": statistics.mean(cpu[:-1] or cpu) if cpu else float("nan"),
        **heard,
    }


async def sweep(history: int, live: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="baton-sweep-") as tmp:
        server = NatsServer(Path(tmp) / "nats")
        await server.start()
        try:
            nc = await connect(server.url, "sweep")
            js = nc.jetstream()
            await ensure(js)
            runs = await Runs.open(js)
            kv = await js.key_value(names.RUNS_BUCKET)
            sem = asyncio.Semaphore(512)

            async def ended(i: int) -> None:
                r = msgspec.structs.replace(record(f"h{i}"), state=RunState.COMPLETED)
                async with sem:
                    await archive.keep(js, r)
                    await kv.put(r.run_id, encode(r))

            async def running(i: int) -> None:
                async with sem:
                    await runs.create(record(f"l{i}"))

            await asyncio.gather(*(ended(i) for i in range(history)))
            await asyncio.gather(*(running(i) for i in range(live)))
            t0 = time.perf_counter()
            found = await runs.live()
            live_s = time.perf_counter() - t0
            assert len(found) == live, len(found)
            t0 = time.perf_counter()
            everything = await runs.all()
            all_s = time.perf_counter() - t0
            assert len(everything) == live + history, len(everything)
            await nc.close()
            return {"history": history, "live_s": live_s, "all_s": all_s}
        finally:
            await server.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", default="1000,5000,10000")
    p.add_argument("--hub-nodes", default="1,3", help="hub sizes to measure, e.g. 1,3")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--ttl", type=int, default=10)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--history", default="0,10000,100000")
    p.add_argument("--live", type=int, default=100)
    p.add_argument("--pulse", type=float, default=Settings().pulse_s, help="0: no pulses")
    p.add_argument("--pulses-only", action="store_true", help="the pulses' own cost")
    p.add_argument("--worker", type=int, default=-2, help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker == -1:
        print(json.dumps(await listener(a.url, a.seconds, a.pulse)), flush=True)
        return
    if a.worker <= -3:
        result = await pulser(a.url, -3 - a.worker, a.count, a.seconds, a.pulse)
        print(json.dumps(result), flush=True)
        return
    if a.pulses_only:
        for n in (int(x) for x in a.trainers.split(",") if x):
            r = await pulses_only(n, a.procs, a.seconds, a.pulse)
            print(
                f"1 node, {n:>6} trainers pulsing only: {r['sent_per_s']:,.0f} pulses/s sent,"
                f" {r['heard_per_s']:,.0f}/s heard; server {r['server_cores']:.2f} cores,"
                f" the reaper's watch {r['cpu_cores']:.2f} cores; {r['judged']} judged silent",
                flush=True,
            )
        return
    if a.worker >= 0:
        result = await worker(a.url, a.worker, a.count, a.seconds, a.ttl, a.pulse)
        print(json.dumps(result), flush=True)
        return
    sizes = [int(x) for x in a.hub_nodes.split(",") if x]
    for nodes, n in [(h, t) for h in sizes for t in (int(x) for x in a.trainers.split(",") if x)]:
        r = await fleet(n, nodes, a.procs, a.seconds, a.ttl, a.pulse)
        pulses = r["pulses"]
        heard = (
            f"; pulses heard {pulses['heard_per_s']:,.0f}/s for {pulses['cpu_cores']:.2f} cores"
            f" of the reaper's, {pulses['judged']} judged silent"
            if pulses else ""
        )  # fmt: skip
        print(
            f"{r['nodes']} node{'s' if nodes > 1 else ''}, {r['trainers']:>6} trainers: "
            f"renewal p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms over {r['renewals']:,}; failed {r['failed']}, "
            f"errors {r['errors']}; timers late p99 {r['late_p99_ms']:.0f} ms; server "
            f"{r['server_cores']:.2f} cores, {r['server_mem_mib']:.0f} MiB{heard}",
            flush=True,
        )
    base = None
    for h in [int(x) for x in a.history.split(",") if x]:
        s = await sweep(h, a.live)
        base = base or s["live_s"]
        print(
            f"sweep read, {a.live} live + {h:,} ended: live index {s['live_s'] * 1000:.0f} ms "
            f"({s['live_s'] / base:.2f}x with no history); every record "
            f"{s['all_s'] * 1000:.0f} ms ({s['all_s'] / s['live_s']:.1f}x the live index)",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    asyncio.run(main())
