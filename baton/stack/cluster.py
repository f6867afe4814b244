"""A hub of several nats-servers on loopback: one JetStream cluster (`baton up --hub-nodes 3`).

Every node is a full hub server (domain `hub`, a WebSocket listener for sites, the same
authorization) and a route to the others. Streams and buckets are kept on `replicas` of
them (`Settings.replicas`), so the hub keeps its records, leases and queues through the
loss of any one machine; clients and leaf nodes are given every node's URL and move to
another node by themselves (docs/architecture.md, "A clustered hub").

JetStream refuses to run clustered without its routes configured, so the route ports must
be known before any node starts: unlike client ports, which each server picks and reports
itself, they are chosen here — fixed ones next to a fixed client port, or free ones found
by binding port 0, and picked again should another process bind one first — and pinned
for the cluster's life, so a node restarted on its store finds its peers where they were.

A route is a way around every client's authorization (a peer sees all traffic), so the
routes of every hub `baton up` clusters are authenticated and encrypted
(`baton.stack.routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from baton.stack.natsconf import HOST, ClusterRoutes
from baton.stack.natsserver import NatsServer
from baton.stack.routes import RouteAuth, issue_route_certs

CLUSTER_NAME = "baton-hub"
ROUTE_PORT_OFFSET = 2000
"""A fixed hub on 4222 routes on 6222 (NATS's conventional pair), 4223 on 6223, ..."""
ROUTE_PORT_TRIES = 3


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on loopback right now. Held open together while they are
    read, so no two are the same; another process could still take one before the server
    binds it, which the server then reports by failing to start."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class HubCluster:
    """`nodes` servers as one cluster; `make(i, routes)` builds node `i` (its data dir, ports
    and config fragments) given its `ClusterRoutes` — None for a hub of one node, which is a
    plain server with no routes (JetStream unclustered, as it has always run). With `auth`,
    every route needs its credentials and a certificate of this cluster's CA (issued here,
    one per node); without, routes are open (loopback tests of JetStream alone)."""

    def __init__(
        self,
        nodes: int,
        make: Callable[[int, ClusterRoutes | None], NatsServer],
        route_ports: list[int] | None = None,
        *,
        auth: RouteAuth | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a hub needs at least one node, not {nodes}")
        self._repick = route_ports is None and nodes > 1
        if nodes == 1:
            self.nodes = [make(0, None)]
            return
        ports = tuple(route_ports or free_ports(nodes))
        if len(ports) != nodes:
            raise ValueError(f"{nodes} nodes need {nodes} route ports, not {len(ports)}")
        tls = issue_route_certs(auth.tls_dir, nodes) if auth else [None] * nodes
        creds = {"user": auth.user, "password": auth.password} if auth else {}
        self.nodes = [
            make(i, ClusterRoutes(name=CLUSTER_NAME, port=ports[i], ports=ports, tls=t, **creds))
            for i, t in enumerate(tls)
        ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what services and the CLI are given."""
        return ",".join(n.url for n in self.nodes)

    @property
    def ws_urls(self) -> list[str]:
        """Every node's WebSocket URL for sites' leaf nodes, once started."""
        return [u for n in self.nodes for u in n.ports.get("websocket", [])[:1]]

    def node(self, server_name: str) -> NatsServer:
        return next(n for n in self.nodes if n.server_name == server_name)

    @property
    def pids(self) -> dict[str, int]:
        """Running nodes' pids by role name: `nats-server` alone, else `nats-server-N`."""
        if len(self.nodes) == 1:
            return {"nats-server": p} if (p := self.nodes[0].pid) else {}
        return {f"nats-server-{i + 1}": p for i, n in enumerate(self.nodes) if (p := n.pid)}

    async def wait_any(self) -> NatsServer:
        """Wait until some node's process exits; that node."""
        waits = {asyncio.create_task(n.wait()): n for n in self.nodes}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()
        return waits[next(iter(done))]

    async def start(self) -> None:
        """Start every node at once: none is ready before a majority of them is up (its
        JetStream needs a meta leader). Route ports picked here are only free when picked:
        if another process binds one before its node does (two stacks starting side by
        side), all are picked again and the nodes started anew, `ROUTE_PORT_TRIES` times at
        most. Fixed ones are not: a taken fixed port is the caller's to resolve."""
        for attempt in range(1, ROUTE_PORT_TRIES + 1):
            failed = await self._start_nodes()
            if failed is None:
                return
            await self.kill()
            taken = "address already in use" in str(failed)
            if not (taken and self._repick and attempt < ROUTE_PORT_TRIES):
                raise failed
            ports = tuple(free_ports(len(self.nodes)))
            for i, n in enumerate(self.nodes):
                assert n.cluster is not None
                n.cluster = msgspec.structs.replace(n.cluster, port=ports[i], ports=ports)

    async def _start_nodes(self) -> BaseException | None:
        """Start every node; the first failure, once the others are stopped (cancelled, a
        starting node kills its server), or None. The rest need not wait out their
        start-up timeout for a peer that will never come."""
        tasks = [asyncio.create_task(n.start()) for n in self.nodes]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return next((e for t in done if (e := t.exception()) is not None), None)

    async def reload(self, extra_config: str) -> None:
        """Every node's `NatsServer.reload` at once — each decides on its own connections,
        so a person let in or out is so at every node — then the first node's failure, if
        any, once all were tried (a node down meanwhile starts with `extra_config`)."""
        done = await asyncio.gather(
            *(n.reload(extra_config) for n in self.nodes), return_exceptions=True
        )
        if failed := [e for e in done if isinstance(e, BaseException)]:
            raise failed[0]

    async def stop(self, timeout_s: float | None = None) -> None:
        await asyncio.gather(*(n.stop(timeout_s) for n in self.nodes))

    async def kill(self) -> None:
        await asyncio.gather(*(n.kill() for n in self.nodes))

    async def __aenter__(self) -> HubCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def leader_of(js: JetStreamContext, stream: str) -> str:
    """The server name of the node leading `stream` (a bucket's stream is `KV_<bucket>`);
    waits out an election."""
    while True:
        with contextlib.suppress(Exception):
            info = await js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return info.cluster.leader
        await asyncio.sleep(0.05)


async def current(js: JetStreamContext, stream: str, replicas: int) -> bool:
    """Whether `stream` has a leader and `replicas - 1` followers, all caught up."""
    try:
        info = await js.stream_info(stream)
    except Exception:
        return False
    c = info.cluster
    if c is None or not c.leader:
        return False
    peers = [r for r in c.replicas or [] if r.current and not r.offline]
    return len(peers) == replicas - 1


def data_dir(root: Path, i: int) -> Path:
    """Node `i`'s directory under the hub's `nats/` directory."""
    return root / f"hub-{i + 1}"
