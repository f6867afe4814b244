"""The stack's nats-servers: the hub's nodes (`hub`, one JetStream cluster of `hub_nodes`)
or a site's leaf node, each configured from the stack's options and authority."""

from __future__ import annotations

import os
from pathlib import Path

from baton.stack.authority import authorization_for, hub_config
from baton.stack.cluster import ROUTE_PORT_OFFSET, HubCluster, data_dir
from baton.stack.natsconf import ClusterRoutes, leaf_fragment
from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, operator_options, vault
from baton.stack.routes import RouteAuth
from shared.bus import names
from shared.credentials import read_env_file

SINGLE_NODE_SYNC = "always"
"""A single server (the hub of one node, a site's leaf) fsyncs every acknowledged write:
JetStream acknowledges before it syncs (every 2 min by default), so a host crash would roll
its records, leases and ledger back while the checkpoint store kept everything
(docs/architecture.md, "The hub may forget"; cost in docs/benchmarks.md). A clustered hub
keeps the default: an acknowledged write is on a majority of its nodes. `BATON_NATS_SYNC`
overrides it (`default`: the server's own interval; or a duration such as `10s`)."""


def single_node_sync() -> str | None:
    """The `sync_interval` of a single server: `BATON_NATS_SYNC`, else `SINGLE_NODE_SYNC`;
    None for the server's default."""
    chosen = os.environ.get("BATON_NATS_SYNC", SINGLE_NODE_SYNC).strip()
    return None if chosen in ("", "default") else chosen


def nats_server(
    opts: StackOptions,
    stop_timeout_s: float = 10.0,
    http_port: int | None = None,
    *,
    node: int = 0,
    routes: ClusterRoutes | None = None,
) -> NatsServer:
    """The hub's server (node `node` of it, a route of `routes`), or a site's leaf node.
    `http_port` turns monitoring on."""
    data = opts.data_dir.absolute()
    v = vault(opts)
    probe = operator_options(opts)
    if opts.site:
        auth = authorization_for(opts, v) if v else ""
        hub_urls = [u.strip() for u in opts.hub_url.split(",") if u.strip()]
        if v is not None:
            link = read_env_file(Path(opts.hub_auth))
            hub_urls = [_with_user(u, link.user, link.password) for u in hub_urls]
        return NatsServer(
            data / "nats", port=opts.port, server_name=opts.site, domain=opts.site,
            extra_config=leaf_fragment(hub_urls) + "\n" + auth, stop_timeout_s=stop_timeout_s,
            http_port=http_port, probe=probe, sync_interval=single_node_sync(),
        )  # fmt: skip
    if routes is None:
        return NatsServer(
            data / "nats", port=opts.port, domain=names.HUB_DOMAIN, ws_port=opts.hub_ws_port,
            extra_config=hub_config(opts, v), stop_timeout_s=stop_timeout_s,
            http_port=http_port, probe=probe, sync_interval=single_node_sync(),
        )  # fmt: skip
    return NatsServer(
        data_dir(data / "nats", node), port=_nth(opts.port, node), server_name=f"hub-{node + 1}",
        domain=names.HUB_DOMAIN, ws_port=_nth(opts.hub_ws_port, node), cluster=routes,
        extra_config=hub_config(opts, v), stop_timeout_s=stop_timeout_s,
        http_port=http_port, probe=probe,
    )  # fmt: skip


def hub(
    opts: StackOptions, stop_timeout_s: float = 10.0, http_port: int | None = None
) -> HubCluster:
    """The stack's nats-servers: the hub's `hub_nodes` (one by default), or a site's leaf."""
    nodes = 1 if opts.site else opts.hub_nodes
    route_ports = (
        [_nth(opts.port + ROUTE_PORT_OFFSET, i) for i in range(nodes)] if opts.port else None
    )
    return HubCluster(
        nodes,
        lambda i, routes: nats_server(opts, stop_timeout_s, http_port, node=i, routes=routes),
        route_ports,
        # Whether or not its clients need credentials: a route sees every message.
        auth=RouteAuth.in_vault(opts.data_dir.absolute() / "auth") if nodes > 1 else None,
    )


def _nth(port: int, node: int) -> int:
    """Node `node`'s port: the next ones after a fixed first port; 0 (any) stays 0."""
    return port + node if port else 0


def _with_user(url: str, user: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"
