"""The NATS settings that make a hub and its sites, for servers Baton starts itself: a
server's own (`server_settings`), a cluster's routes (`ClusterRoutes`, `cluster_block`), and
the fragments below.

`baton up`, `baton up --site` and the tests run `NatsServer` with these fragments; they are
the loopback form of `deploy/nats/dev/hub.conf` and `leaf.conf` (tests/deploy checks that
the two agree on every setting that matters: domains, pings, reconnect).

Pings every 2 s, two missed: a silent partition (TCP open, bytes lost) is noticed in about
5 s on both sides, where the defaults took minutes (docs/nats.md). The leaf redials every
second once the link is gone.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import msgspec

HOST = "127.0.0.1"
"""Where every server Baton starts itself listens: loopback."""

PING_INTERVAL = '"2s"'
PING_MAX = 2
LEAF_RECONNECT = '"1s"'


def hub_fragment() -> str:
    """A hub that leaf nodes join over WebSocket (`NatsServer(ws_port=…)` adds the plain
    ws:// listener on loopback; TLS in deployment). The `leafnodes` block is required even
    though leaves dial the WebSocket port."""
    return "\n".join(
        [
            f"ping_interval: {PING_INTERVAL}",
            f"ping_max: {PING_MAX}",
            "leafnodes {\n  listen: 127.0.0.1:-1\n}",
        ]
    )


def leaf_fragment(hub_ws_urls: list[str]) -> str:
    """A site's leaf node dialling the hub's WebSocket listener at `hub_ws_urls`: every
    node of a clustered hub, so that the link moves to another node when one is lost."""
    return "\n".join(
        [
            f"ping_interval: {PING_INTERVAL}",
            f"ping_max: {PING_MAX}",
            "leafnodes {",
            f"  reconnect: {LEAF_RECONNECT}",
            f"  remotes [ {{ urls: [{', '.join(json.dumps(u) for u in hub_ws_urls)}] }} ]",
            "}",
        ]
    )


class RouteTls(msgspec.Struct, frozen=True, kw_only=True):
    """Mutual TLS between a cluster's nodes: each presents `cert_file` both ways (dialling
    and dialled), and accepts only a peer whose certificate `ca_file` signed."""

    cert_file: Path
    key_file: Path
    ca_file: Path


class ClusterRoutes(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    """The cluster's name, the same on every node."""
    port: int
    """This node's route port."""
    ports: tuple[int, ...]
    """Every node's route port (this one's included: a server ignores a route to itself)."""
    user: str = ""
    """With `password`: the credentials a route must present, and that this node's own
    routes present to its peers. Empty: routes need none (loopback tests only)."""
    password: str = ""
    tls: RouteTls | None = None
    """Routes only over mutual TLS (`verify: true`); None: in the clear."""


def server_settings(
    *, name: str, port: int | None, data_dir: Path, http_port: int | None,
    ws_port: int | None, ws_port_known: int | None, max_payload: int | None,
    jetstream: bool, store_dir: Path, domain: str | None, sync_interval: str | None,
    cluster: ClusterRoutes | None,
) -> str:  # fmt: skip
    """A `NatsServer`'s own settings, before its `extra_config`: its name, its listeners on
    loopback (a port not known yet is -1: any), JetStream's store, and its cluster."""
    # Strings are JSON-quoted: the NATS config syntax accepts them, and it keeps a path
    # with spaces or a '#' from being read as something else.
    lines = [
        f"server_name: {json.dumps(name)}",
        f"listen: {HOST}:{port if port is not None else -1}",
        f"ports_file_dir: {json.dumps(str(data_dir))}",
    ]
    if http_port is not None:
        # Monitoring keeps its port only when one was asked for: "any" is any again at a
        # restart, since the one before may have been taken meanwhile (seen in the suite:
        # a restarted node refusing to start). Clients' and sites' ports are kept: they
        # reconnect to them.
        http = http_port if http_port > 0 else -1
        lines.append(f"http: {HOST}:{http}")
    if ws_port is not None:
        ws = ws_port_known if ws_port_known else -1
        lines.append(f"websocket {{\n  listen: {HOST}:{ws}\n  no_tls: true\n}}")
    if max_payload is not None:
        lines.append(f"max_payload: {max_payload}")
    if jetstream:
        js = [f"store_dir: {json.dumps(str(store_dir))}"]
        if domain:
            js.append(f"domain: {json.dumps(domain)}")
        if sync_interval:
            js.append(f"sync_interval: {json.dumps(sync_interval)}")
        lines.append("jetstream {\n  " + "\n  ".join(js) + "\n}")
    if cluster is not None:
        lines.append(cluster_block(cluster))
    return "\n".join(lines)


def cluster_block(c: ClusterRoutes) -> str:
    """The `cluster` block of node `c`: its listener, its routes to every node, and, where
    `c` has them, the credentials and mutual TLS every route must present."""
    lines = [f"  name: {json.dumps(c.name)}", f"  listen: {HOST}:{c.port}"]
    if c.user:
        lines.append(f"  authorization {json.dumps({'user': c.user, 'password': c.password})}")
    if c.tls is not None:
        files = {k: str(v) for k, v in msgspec.structs.asdict(c.tls).items()}
        lines.append(f"  tls {json.dumps({**files, 'verify': True})}")
    # A route dials with the URL's credentials (the block above only checks those dialled).
    creds = f"{quote(c.user, safe='')}:{quote(c.password, safe='')}@" if c.user else ""
    routes = ", ".join(json.dumps(f"nats-route://{creds}{HOST}:{p}") for p in c.ports)
    lines.append(f"  routes: [{routes}]")
    # The nodes' addresses are not gossiped to clients or to sites' leaf nodes: every
    # client is given every node's URL (`HubCluster.url`), and a site reaches the hub at
    # the address its operator gave it (a load balancer, a proxy, a public name), never at
    # a node's own listener it could not reach, or that bypasses what is between them.
    lines.append("  no_advertise: true")
    return "cluster {\n" + "\n".join(lines) + "\n}"


def appended(extra_config: str) -> str:
    return ("\n" + extra_config if extra_config else "") + "\n"
