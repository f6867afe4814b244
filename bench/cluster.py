"""A clustered hub's costs: publish throughput with three replicas, and how long a stream
takes no writes after its leader is SIGKILLed. Ratios are against a one-node hub measured
in the same run.

    .venv/bin/python -m bench.cluster [--publishes 4000] [--kills 3]

* throughput: `--publishes` publishes to the task stream (Baton's `ensure` definitions),
  each awaiting its ack, 64 in flight, on a one-node hub and on three nodes with
  `BATON_REPLICAS=3`; each with `sync_interval` at its default and at `always`.
* election: on the three-node hub, for the task stream and the leases and runs buckets in
  turn, SIGKILL the stream's leader and time from the kill to the first write that the
  stream acknowledges (one attempt every 50 ms, each waiting at most 1 s). The node is
  started again and every stream caught up before the next kill.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from nats.aio.client import Client

from baton.stack.cluster import HubCluster, current, leader_of
from baton.stack.natsconf import ClusterRoutes
from baton.stack.natsserver import NatsServer
from shared.bus import names
from shared.bus.connect import connect
from shared.bus.streams import ensure

IN_FLIGHT = 64


def cluster(root: Path, nodes: int, sync: str | None) -> HubCluster:
    def make(i: int, routes: ClusterRoutes | None) -> NatsServer:
        return NatsServer(
            root / f"hub-{i + 1}", server_name=f"hub-{i + 1}", domain=names.HUB_DOMAIN,
            cluster=routes, sync_interval=sync,
        )  # fmt: skip

    return HubCluster(nodes, make)


async def throughput(nc: Client, count: int) -> float:
    js = nc.jetstream()
    subject = names.task_subject("bench", "r0")
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        async with sem:
            await js.publish(subject, b"x" * 200, headers={"Nats-Msg-Id": f"b{i}"}, timeout=10)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return count / (time.perf_counter() - start)


async def all_current(nc: Client) -> None:
    js = nc.jetstream()
    while True:
        try:
            streams = [i.config.name for i in await js.streams_info() if i.config.name]
            if len(streams) >= len(names.ALL_STREAMS) - 1 and all(
                await asyncio.gather(*(current(js, s, 3) for s in streams))
            ):
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)


async def outage(hub: HubCluster, nc: Client, stream: str) -> float:
    """Seconds from SIGKILLing `stream`'s leader to its first acknowledged write."""
    js = nc.jetstream()
    subject = (
        names.task_subject("bench", "probe")
        if stream == names.TASKS_STREAM
        else f"$KV.{stream.removeprefix('KV_')}.probe"
    )
    node = hub.node(await leader_of(js, stream))
    killed = time.perf_counter()
    await node.kill()
    while True:
        try:
            await js.publish(subject, b"", timeout=1)
            took = time.perf_counter() - killed
            break
        except Exception:
            await asyncio.sleep(0.05)
    await node.start()
    await all_current(nc)
    return took


async def measure(nodes: int, sync: str | None, publishes: int, kills: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        hub = cluster(Path(tmp), nodes, sync)
        await hub.start()
        try:
            nc = await connect(hub.url, "bench", first_attempt_timeout=10)
            await ensure(nc.jetstream(), replicas=min(3, nodes))
            if nodes > 1:
                await all_current(nc)
            rate = await throughput(nc, publishes)
            outages: list[float] = []
            if nodes > 1:
                streams = [
                    names.TASKS_STREAM,
                    f"KV_{names.LEASES_BUCKET}",
                    f"KV_{names.RUNS_BUCKET}",
                ]
                for i in range(kills):
                    outages.append(await outage(hub, nc, streams[i % len(streams)]))
            await nc.close()
            return {"rate": rate, "outages": outages}
        finally:
            await hub.stop()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--publishes", type=int, default=4000)
    p.add_argument("--kills", type=int, default=3)
    a = p.parse_args()
    results = {}
    for nodes, sync in ((1, None), (3, None), (1, "always"), (3, "always")):
        kills = a.kills if sync is None else 0
        results[(nodes, sync)] = r = await measure(nodes, sync, a.publishes, kills)
        print(f"nodes={nodes} sync={sync or 'default'}: {r['rate']:,.0f} publishes/s", flush=True)
    base = results[(1, None)]["rate"]
    assert isinstance(base, float)
    for (nodes, sync), r in results.items():
        rate = r["rate"]
        assert isinstance(rate, float)
        print(f"  {nodes} node(s), sync {sync or 'default'}: {rate / base:.2f}x one node")
    outages = results[(3, None)]["outages"]
    assert isinstance(outages, list)
    if outages:
        print(
            "write outage after a leader's SIGKILL: "
            + ", ".join(f"{o:.2f}s" for o in outages)
            + f"; p50 {statistics.median(outages):.2f}s, max {max(outages):.2f}s"
        )


if __name__ == "__main__":
    asyncio.run(main())
