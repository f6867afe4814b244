"""The NATS settings that make a hub and its sites, for servers Baton starts itself.

`baton up`, `baton up --site` and the tests run `NatsServer` with these fragments; they are
the loopback form of `deploy/nats/dev/hub.conf` and `leaf.conf` (tests/deploy checks that
the two agree on every setting that matters: domains, pings, reconnect).

Pings every 2 s, two missed: a silent partition (TCP open, bytes lost) is noticed in about
5 s on both sides, where the defaults took minutes (docs/nats.md). The leaf redials every
second once the link is gone.
"""

from __future__ import annotations

import json

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
