"""`baton up --port 0`: every port the stack opens is a free one, so two stacks run side by
side on one machine. Which ports a stack's servers listen on is read from the kernel
(/proc), not from their configs: a listener nobody asked for would show up there too.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import time
from pathlib import Path

import nats
import pytest
import typer.main

from baton.cli.app import app
from baton.stack.lifecycle import run_stack
from baton.stack.options import DEFAULT_WS_PORT, StackOptions
from baton.stack.procs import ServiceSpec
from baton.stack.servers import hub
from tests.support.stack import eventually

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def test_port_0_makes_the_websocket_port_free_too() -> None:
    assert StackOptions().hub_ws_port == DEFAULT_WS_PORT
    assert StackOptions(port=5000).hub_ws_port == DEFAULT_WS_PORT
    assert StackOptions(port=0).hub_ws_port == 0
    assert StackOptions(port=0, ws_port=9000).hub_ws_port == 9000  # named, kept
    assert StackOptions(port=5000, ws_port=0).hub_ws_port == 0
    up = typer.main.get_command(app).commands["up"]  # type: ignore[attr-defined]
    (ws,) = [p for p in up.params if p.name == "ws_port"]
    assert ws.default is None, "`baton up --port 0` must not get the fixed 8080"


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on, from its sockets in /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def no_services(opts: StackOptions, nats_url: str) -> list[ServiceSpec]:
    return []  # the stack's servers alone: they are what opens ports


async def jetstream_answers(url: str) -> bool:
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    except Exception:
        return False
    try:
        await nc.jetstream(timeout=2).account_info()
        return True
    except Exception:
        return False
    finally:
        await nc.close()


async def test_two_port_0_stacks_share_no_port(tmp_path: Path) -> None:
    """Two clustered hubs as `baton up --port 0 --hub-nodes 3` starts them, at once: both
    serve on every node, and no port of one is a port of the other (clients, WebSocket,
    leaf nodes, routes)."""
    stop = asyncio.Event()
    data = [tmp_path / "a", tmp_path / "b"]
    started = time.monotonic()
    opts = [StackOptions(data_dir=d, port=0, hub_nodes=3, auth=False) for d in data]
    stacks = [
        asyncio.create_task(run_stack(o, stop=stop, build_specs=no_services, out=io.StringIO()))
        for o in opts
    ]
    try:

        async def both_up() -> bool:
            assert not any(t.done() for t in stacks), [t.result() for t in stacks if t.done()]
            return all((d / "run" / "stack.json").exists() for d in data)

        await eventually(both_up, 90, "both stacks' stack.json")
        print(f"both stacks up in {time.monotonic() - started:.1f} s")
        infos = [json.loads((d / "run" / "stack.json").read_text()) for d in data]
        opened = []
        for info in infos:
            for url in info["nats_url"].split(","):
                await eventually(lambda u=url: jetstream_answers(u), 30, f"JetStream at {url}")
            pids = [p for role, p in info["pids"].items() if role.startswith("nats-server")]
            assert len(pids) == 3, info["pids"]
            ports = set().union(*(listening_ports(p) for p in pids))
            named = {
                int(u.rsplit(":", 1)[1])
                for u in info["nats_url"].split(",") + info["sites_url"].split(",")
            }
            assert DEFAULT_WS_PORT not in named, info["sites_url"]
            assert named <= ports, (named, ports)
            # Per node: clients, WebSocket, leaf nodes, routes.
            assert len(ports) == 12, sorted(ports)
            opened.append(ports)
        assert not opened[0] & opened[1], f"ports in common: {sorted(opened[0] & opened[1])}"
    finally:
        stop.set()
        results = await asyncio.wait_for(asyncio.gather(*stacks), 60)
    assert results == [0, 0], results


async def test_a_route_port_taken_before_its_node_binds_it_is_picked_again(
    tmp_path: Path,
) -> None:
    """Route ports must be known before any node starts, so they are picked free ahead of
    time; one that another process binds meanwhile (as another stack may) is picked again,
    and the cluster still forms."""
    nodes = hub(StackOptions(data_dir=tmp_path, port=0, hub_nodes=3, auth=False))
    first = nodes.nodes[1].cluster
    assert first is not None
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first.port))
        squatter.listen()
        try:
            await nodes.start()
            ports = [n.cluster.port for n in nodes.nodes if n.cluster is not None]
            assert first.port not in ports and len(set(ports)) == 3, (first.port, ports)
            for n in nodes.nodes:
                assert await jetstream_answers(n.url), n.server_name
                assert listening_ports(n.pid or 0) >= {n.port, n.cluster.port}  # type: ignore[union-attr]
        finally:
            await nodes.stop()
    assert "address already in use" in nodes.nodes[1].log_path.read_text()
