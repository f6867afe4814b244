"""A clustered hub's routes (`baton up --hub-nodes 3`): a server joins only with the
cluster's route password *and* a certificate of the cluster's own CA, over TLS. A fourth
nats-server dialling the route ports short of any one of those is refused, again and again,
and never holds a route; the three nodes stay one JetStream cluster meanwhile.

Real nats-servers on loopback, free ports; evidence from the servers themselves: `/routez`
on every node and on the intruder, and the intruder's log for why it was turned away.
"""

from __future__ import annotations

import asyncio
import json
import stat
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from baton.stack.cluster import CLUSTER_NAME, HubCluster, current, free_ports
from baton.stack.natsconf import ClusterRoutes, RouteTls
from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, operator_options
from baton.stack.routes import ROUTE_USER, issue_route_certs
from baton.stack.servers import hub
from tests.support.stack import eventually

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

NODES = {"hub-1", "hub-2", "hub-3"}


async def monitor(server: NatsServer, path: str) -> Any:
    """GET a monitoring endpoint of `server` as JSON."""

    def get() -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=2) as r:
            return json.loads(r.read())

    return await asyncio.to_thread(get)


async def peers(server: NatsServer) -> set[str]:
    """The server names at the other end of `server`'s routes."""
    routes = (await monitor(server, "/routez")).get("routes") or []
    return {r.get("remote_name", "") for r in routes}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[StackOptions, HubCluster]]:
    """Three nodes as `baton up --port 0 --hub-nodes 3` makes them, monitoring on."""
    opts = StackOptions(data_dir=tmp_path / "hub", port=0, hub_nodes=3)
    nodes = hub(opts, http_port=0)
    try:
        await nodes.start()
        yield opts, nodes
    finally:
        await nodes.stop()


def intruder(
    root: Path, name: str, nodes: HubCluster, *, password: str, tls: RouteTls | None
) -> NatsServer:
    """A fourth server whose routes dial every node's route port with `password` (none if
    empty) and `tls` (in the clear if None). No JetStream: it only wants to be routed."""
    (own,) = free_ports(1)
    assert nodes.nodes[0].cluster is not None
    routes = ClusterRoutes(
        name=CLUSTER_NAME, port=own, ports=(*nodes.nodes[0].cluster.ports, own),
        user=ROUTE_USER if password else "", password=password, tls=tls,
    )  # fmt: skip
    return NatsServer(root / name, server_name=name, jetstream=False, http_port=0, cluster=routes)


def hub_log(nodes: HubCluster) -> str:
    return "".join(n.log_path.read_text(errors="replace") for n in nodes.nodes)


async def test_routes_need_the_password_and_a_certificate_of_the_clusters_ca(
    cluster: tuple[StackOptions, HubCluster], tmp_path: Path
) -> None:
    opts, nodes = cluster
    secret = (opts.data_dir.absolute() / "auth" / "route.secret").read_text().strip()
    certs = opts.data_dir.absolute() / "auth" / "routes"
    for key in certs.glob("*-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert not list(certs.glob("ca-key*")), "the CA's key must never be written"
    # A node's certificate and key, as if stolen; and a certificate of a CA the cluster
    # never heard of, its holder trusting the cluster's CA too (so that it is the node,
    # not the intruder, that ends the handshake).
    stolen = nodes.nodes[2].cluster.tls if nodes.nodes[2].cluster else None
    assert stolen is not None
    (other,) = issue_route_certs(tmp_path / "other-ca", 1)
    both = tmp_path / "both-cas.pem"
    both.write_text(stolen.ca_file.read_text() + other.ca_file.read_text())
    foreign = RouteTls(cert_file=other.cert_file, key_file=other.key_file, ca_file=both)
    refused = {
        # name: (its routes' password and TLS, what the nodes log of each refusal)
        "no-password": ("", stolen, "authentication error"),
        "wrong-password": ("guessed", stolen, "authentication error"),
        "no-tls": (secret, None, "first record does not look like a TLS handshake"),
        "another-ca": (secret, foreign, "certificate signed by unknown authority"),
    }
    # One at a time, so that each refusal in the nodes' logs is the one intruder's.
    for name, (password, tls, why) in refused.items():
        before = hub_log(nodes).count(why)
        server = intruder(tmp_path, name, nodes, password=password, tls=tls)
        try:
            await server.start()

            async def refused_twice(why: str = why, before: int = before) -> bool:
                return hub_log(nodes).count(why) >= before + 2

            await eventually(refused_twice, 30, f"{name}: two refusals ({why!r})")
            if password != secret:
                assert server.log_tail(100).count("Authorization Violation") >= 2, name

            async def unrouted(server: NatsServer = server) -> bool:
                # A refused dial may show in the intruder's routes for the moment between
                # its TLS handshake and the node's refusal (seen once in CI): none is held.
                routez = await monitor(server, "/routez")
                return not routez.get("routes") and routez["num_routes"] == 0

            await eventually(unrouted, 30, f"{name} to hold no route")
            for node in nodes.nodes:
                assert await peers(node) == NODES - {node.server_name}, (name, node.server_name)
        finally:
            await server.stop()
    await assert_one_jetstream_cluster(opts, nodes)

    # The control: the same fourth server, given the password and a node's certificate,
    # does join — so each refusal above was for what that intruder lacked.
    control = intruder(tmp_path, "control", nodes, password=secret, tls=stolen)
    try:
        await control.start()

        async def routed() -> bool:
            return await peers(control) == NODES

        await eventually(routed, 30, "the control server routed to every node")
    finally:
        await control.stop()
    for node in nodes.nodes:
        for path in ("/varz", "/routez"):
            assert secret not in json.dumps(await monitor(node, path)), f"{path} shows it"
    assert secret not in hub_log(nodes), "the route password is logged"


async def assert_one_jetstream_cluster(opts: StackOptions, nodes: HubCluster) -> None:
    """A meta leader every node agrees on, and a stream kept on all three."""
    leaders = set()
    for node in nodes.nodes:
        meta = (await monitor(node, "/jsz")).get("meta_cluster") or {}
        assert meta.get("cluster_size") == 3, meta
        leaders.add(meta.get("leader"))
    assert len(leaders) == 1 and leaders <= NODES, leaders
    nc = await nats.connect(nodes.url.split(","), **operator_options(opts))
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(name="ROUTED", subjects=["routed.>"], num_replicas=3)
        ack = await js.publish("routed.x", b"over TLS")
        assert ack.seq == 1, ack

        async def on_all_three() -> bool:
            return await current(js, "ROUTED", 3)

        await eventually(on_all_three, 30, "the stream current on all three nodes")
    finally:
        await nc.close()
