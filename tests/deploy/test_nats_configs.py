"""The committed NATS configs (deploy/nats/), run by the real nats-server.

Dev variant (deploy/nats/dev/): a leaf dials the hub over plain ws:// on loopback.
Deployment variant (deploy/nats/hub.conf, leaf.conf — what compose runs): the leaf dials
wss:// with the CA from deploy/certs/gen-dev-certs.sh; a leaf trusting another CA is
refused. compose's three hub nodes (hub-node.conf) form one cluster over routes that need
the route password and a certificate of the routes' CA; a server short of either is refused.
Also re-checks the facts in docs/nats.md the configs rely on: the hub's `leafnodes`
block, duration strings, pings that notice a silent partition in ~4 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest

from tests.deploy.natsconf import (
    NATS_DIR,
    ROUTE_CERT_SCRIPT,
    ConfiguredServer,
    check_config,
    gen_certs,
    localize,
    mount_certs,
    node_env,
    passwords_for,
    strip_comments,
)

POLL_S = 0.05
LINK_WITHIN_S = 15.0

Launch = Callable[..., Awaitable[ConfiguredServer]]
HUB_NODES = ("hub-1", "hub-2", "hub-3")


@pytest.fixture
async def launch(tmp_path: Path) -> AsyncIterator[Launch]:
    """Starts localized configs; stops every server it started, whatever the test did."""
    started: list[ConfiguredServer] = []

    async def go(
        name: str,
        conf: str,
        *,
        env: dict[str, str] | None = None,
        certs_dir: Path | None = None,
        remote_url: str | list[str] | None = None,
        text: str | None = None,
        route_port: int | None = None,
    ) -> ConfiguredServer:
        """Start `conf` (relative to deploy/nats/), or `text` in its place."""
        workdir = tmp_path / name
        if text is None:
            text = (NATS_DIR / conf).read_text()
        config = localize(
            text, workdir, certs_dir=certs_dir, remote_url=remote_url, route_port=route_port
        )
        # The committed configs read their users' passwords from the environment.
        env = {**passwords_for(config), **(env or {})}
        server = ConfiguredServer(name, config, workdir, env=env)
        started.append(server)
        return await server.start()

    try:
        yield go
    finally:
        for server in reversed(started):
            await server.stop()


async def wait_for(cond: Callable[[], Awaitable[bool]], within: float, what: str) -> float:
    """Poll until `cond()` holds; returns the seconds it took. No fixed sleeps."""
    start = time.monotonic()
    while not await cond():
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(POLL_S)
    return time.monotonic() - start


async def linked(hub: ConfiguredServer, site: str) -> None:
    async def up() -> bool:
        return site in await hub.leaf_names()

    try:
        await wait_for(up, LINK_WITHIN_S, f"leaf {site!r} in the hub's /leafz")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nhub log:\n{hub.log()[-3000:]}") from None


async def assert_domains(leaf: ConfiguredServer, site: str, **creds: str) -> None:
    """From a client of the leaf, both JetStream domains answer (the hub's across the link)."""
    nc = await nats.connect(leaf.client_url, allow_reconnect=False, **creds)
    try:
        hub_info = await nc.jetstream(domain="hub", timeout=5).account_info()
        assert hub_info.domain == "hub", hub_info
        site_info = await nc.jetstream(domain=site, timeout=5).account_info()
        assert site_info.domain == site, site_info
        local = await nc.jetstream(timeout=5).account_info()
        assert local.domain == site, f"a leaf client's own JetStream is {local.domain!r}"
    finally:
        await nc.close()


# -- dev variant: ws:// on loopback ----------------------------------------------------------


@pytest.mark.parametrize("site", ["site1", "edge-b"])
async def test_dev_leaf_joins_hub_over_websocket(launch: Launch, site: str) -> None:
    assert "$SITE" in (NATS_DIR / "dev" / "leaf.conf").read_text()
    hub = await launch("hub", "dev/hub.conf")
    leaf = await launch(
        "leaf",
        "dev/leaf.conf",
        env={"SITE": site},
        remote_url=f"ws://127.0.0.1:{hub.ws_port}",
    )
    await linked(hub, site)

    leafz = await hub.monitor("/leafz")
    (link,) = leafz["leafs"]
    assert link["name"] == site and link["websocket"] is True, link
    (back,) = (await leaf.monitor("/leafz"))["leafs"]
    assert back["name"] == "hub" and back["websocket"] is True, back
    varz = await leaf.monitor("/varz")
    assert varz["server_name"] == site, varz["server_name"]
    assert varz["ping_interval"] == 2_000_000_000 and varz["ping_max"] == 2, varz

    await assert_domains(leaf, site)
    # The hub reaches the site's domain too (what sourcing a site stream needs).
    nc = await nats.connect(hub.client_url, allow_reconnect=False)
    try:
        info = await nc.jetstream(domain=site, timeout=5).account_info()
        assert info.domain == site, info
    finally:
        await nc.close()
    assert f'local "hub", remote "{site}"' in hub.log(), hub.log()[-2000:]


async def test_leaf_without_site_fails_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The site name has no silent default: a leaf started without SITE refuses to start."""
    monkeypatch.delenv("SITE", raising=False)
    (tmp_path / "ca.pem").write_text("")  # `-t` opens the CA file; its content is not read
    for conf in ("dev/leaf.conf", "leaf.conf"):
        text = (NATS_DIR / conf).read_text().replace("/etc/nats/certs/", f"{tmp_path}/")
        rc, out = await check_config(text, tmp_path / "check")
        assert rc != 0, out
        assert "variable reference for 'SITE'" in out, out


async def test_durations_must_be_strings(tmp_path: Path) -> None:
    """docs/nats.md: `reconnect` must be a duration string; so must `ping_interval`."""
    text = (NATS_DIR / "dev" / "leaf.conf").read_text()
    env = {"SITE": "site1"}
    rc, out = await check_config(text, tmp_path / "ok", env=env)
    assert rc == 0, out
    for key, string, bare in [
        ("reconnect", 'reconnect: "1s"', "reconnect: 1"),
        ("ping_interval", 'ping_interval: "2s"', "ping_interval: 2"),
    ]:
        assert string in text, f"{key} is not the duration string {string!r}"
        rc, out = await check_config(text.replace(string, bare), tmp_path / key, env=env)
        assert rc != 0 and "duration" in out, out


async def test_hub_needs_a_leafnodes_block(launch: Launch) -> None:
    """docs/nats.md: without `leafnodes { listen }` the hub refuses leaves on its WebSocket.
    (2.15.1 logs the refusal on the hub; the leaf retries silently at the default level.)"""
    text = (NATS_DIR / "dev" / "hub.conf").read_text()
    assert re.search(r"^leafnodes\s*\{\s*listen:", strip_comments(text), re.M)
    bare = re.sub(r"^leafnodes\s*\{[^}]*\}", "", strip_comments(text), flags=re.M)
    assert "leafnodes" not in bare
    hub = await launch("bare-hub", "dev/hub.conf", text=bare)
    await launch(
        "leaf", "dev/leaf.conf", env={"SITE": "site1"},
        remote_url=f"ws://127.0.0.1:{hub.ws_port}",
    )  # fmt: skip

    async def refused_twice() -> bool:
        assert not await hub.leaf_names(), "a leaf joined a hub with no leafnodes block"
        return hub.log().count("Not configured to accept leaf node connections") >= 2

    await wait_for(refused_twice, 10.0, "two refusals in the hub's log")


async def test_silent_partition_is_noticed_in_about_4s(launch: Launch) -> None:
    """ping_interval "2s" x ping_max 2: a link whose bytes vanish is dropped in ~4 s (the
    defaults took minutes), and the leaf relinks once bytes flow again."""
    hub = await launch("hub", "dev/hub.conf")
    hole = BlackHole(hub.ws_port)
    await hole.start()
    try:
        await launch(
            "leaf", "dev/leaf.conf", env={"SITE": "site1"},
            remote_url=f"ws://127.0.0.1:{hole.port}",
        )  # fmt: skip
        await linked(hub, "site1")

        hole.silent = True

        async def dropped() -> bool:
            return not await hub.leaf_names()

        took = await wait_for(dropped, 15.0, "the hub to drop the silent leaf link")
        assert 2.0 <= took <= 8.0, f"silent link dropped after {took:.1f} s, expected ~4 s"

        hole.silent = False
        relink = await wait_for(
            lambda: _has(hub, "site1"), 10.0, "the leaf to relink after the partition"
        )
        print(f"silent link dropped after {took:.2f} s; relinked {relink:.2f} s after heal")
    finally:
        await hole.stop()


async def _has(hub: ConfiguredServer, site: str) -> bool:
    return site in await hub.leaf_names()


class BlackHole:
    """A loopback TCP relay that can go silent: connections stay open, bytes vanish."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.silent = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.silent:
            writer.transport.abort()  # a real partition: new dials fail too
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if not self.silent:
                        dst.write(data)
                        await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._writers.difference_update((writer, up_w))


# -- deployment variant: wss:// with the dev CA ----------------------------------------------


async def test_tls_leaf_joins_hub_over_wss(launch: Launch, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    await gen_certs(certs)
    hub = await launch("hub", "hub.conf", certs_dir=certs)
    assert hub.ports["websocket"][0].startswith("wss://"), hub.ports
    link_pw = passwords_for("$BATON_PW_SITE_SITE1")["BATON_PW_SITE_SITE1"]
    leaf = await launch(
        "leaf", "leaf.conf", env={"SITE": "site1"}, certs_dir=certs,
        remote_url=f"wss://site-site1:{link_pw}@localhost:{hub.ws_port}",
    )  # fmt: skip
    await linked(hub, "site1")
    (link,) = (await hub.monitor("/leafz"))["leafs"]
    assert link["websocket"] is True, link
    operator = passwords_for("$BATON_PW_SITE1_OPERATOR")["BATON_PW_SITE1_OPERATOR"]
    # Replies cross the link only to a site user's own inbox prefix (shared/auth/site.py).
    await assert_domains(
        leaf, "site1", user="site1-operator", password=operator,
        inbox_prefix="_INBOX_site1_operator",
    )  # fmt: skip
    assert link_pw not in hub.log() + leaf.log(), "the link's password must not be logged"
    assert "TLS handshake error" not in hub.log()


async def test_leaf_trusting_another_ca_is_refused(launch: Launch, tmp_path: Path) -> None:
    await gen_certs(tmp_path / "hub-ca")
    await gen_certs(tmp_path / "other-ca")
    hub = await launch("hub", "hub.conf", certs_dir=tmp_path / "hub-ca")
    link_pw = passwords_for("$BATON_PW_SITE_SITE1")["BATON_PW_SITE_SITE1"]
    leaf = await launch(
        "leaf", "leaf.conf", env={"SITE": "site1"}, certs_dir=tmp_path / "other-ca",
        remote_url=f"wss://site-site1:{link_pw}@localhost:{hub.ws_port}",
    )  # fmt: skip

    async def refused_twice() -> bool:
        names = await hub.leaf_names()
        assert not names, f"a leaf trusting another CA joined: {names}"
        return hub.log().count("websocket: TLS handshake error") >= 2

    # Two refused attempts (reconnect "1s") — the leaf keeps trying and never gets in.
    await wait_for(refused_twice, 10.0, "two refused TLS handshakes in the hub log")
    assert "tls: bad certificate" in hub.log(), hub.log()[-2000:]
    assert "certificate signed by unknown authority" in leaf.log(), leaf.log()[-2000:]
    assert not await hub.leaf_names()


async def test_three_hub_nodes_are_one_cluster_and_a_leaf_given_all_survives_one(
    launch: Launch, tmp_path: Path
) -> None:
    """compose.yaml's hub: hub-node.conf three times. Every node answers for JetStream, a
    stream is kept on all three, and a leaf given every node's URL (an array, from the
    environment as compose gives it) moves its link when the node holding it is lost."""
    certs = tmp_path / "certs"
    hubs = await start_hub_nodes(launch, tmp_path, certs)
    operator = passwords_for("$BATON_PW_OPERATOR")["BATON_PW_OPERATOR"]
    nc = await nats.connect(
        [h.client_url for h in hubs], user="operator", password=operator,
        max_reconnect_attempts=-1, reconnect_time_wait=0.2,
    )  # fmt: skip
    try:
        js = nc.jetstream(timeout=2)

        async def replicated() -> bool:
            with contextlib.suppress(Exception):
                await js.add_stream(name="R3", subjects=["r3.>"], num_replicas=3)
            try:
                info = await js.stream_info("R3")
            except Exception:
                return False
            c = info.cluster
            return bool(c and c.leader and len([r for r in c.replicas or [] if r.current]) == 2)

        await wait_for(replicated, 60, "a stream on all three nodes")
        names = {(await h.monitor("/varz"))["server_name"] for h in hubs}
        assert names == set(HUB_NODES), names
        for h in hubs:  # every route over TLS, none refused on the way
            assert "TLS route handshake error" not in h.log(), h.log()[-2000:]
            assert "authentication error" not in h.log(), h.log()[-2000:]

        link_pw = passwords_for("$BATON_PW_SITE_SITE1")["BATON_PW_SITE_SITE1"]
        leaf = await launch(
            "leaf", "leaf.conf", env={"SITE": "site1"}, certs_dir=certs,
            remote_url=[f"wss://site-site1:{link_pw}@localhost:{h.ws_port}" for h in hubs],
        )  # fmt: skip

        async def holder() -> ConfiguredServer | None:
            for h in hubs:
                with contextlib.suppress(Exception):
                    if "site1" in await h.leaf_names():
                        return h
            return None

        await wait_for(lambda: _some(holder), LINK_WITHIN_S, "the leaf's link to a node")
        first = await holder()
        assert first is not None
        await first.stop()
        await wait_for(
            lambda: _some(holder, lambda h: h is not first), 30, "the link on another node"
        )
        await assert_domains(
            leaf, "site1", user="site1-operator",
            password=passwords_for("$BATON_PW_SITE1_OPERATOR")["BATON_PW_SITE1_OPERATOR"],
            inbox_prefix="_INBOX_site1_operator",
        )  # fmt: skip
    finally:
        await nc.close()


async def _some(
    find: Callable[[], Awaitable[ConfiguredServer | None]],
    ok: Callable[[ConfiguredServer], bool] = lambda _: True,
) -> bool:
    found = await find()
    return found is not None and ok(found)


async def start_hub_nodes(
    launch: Launch, tmp_path: Path, certs: Path, route_ports: list[int] | None = None
) -> list[ConfiguredServer]:
    """compose.yaml's hub on loopback: hub-node.conf three times, each node with the
    environment and the certificates compose gives it (both scripts' output, in `certs`),
    routing on `route_ports` (free ones if None)."""
    from baton.stack.cluster import free_ports

    await gen_certs(certs)
    await gen_certs(certs, ROUTE_CERT_SCRIPT)
    ports = dict(zip(HUB_NODES, route_ports or free_ports(len(HUB_NODES)), strict=True))
    return list(
        await asyncio.gather(
            *(
                launch(n, "hub-node.conf", env=node_env(n, ports), route_port=ports[n],
                       certs_dir=mount_certs(n, certs, tmp_path / f"{n}-certs"))
                for n in HUB_NODES
            )
        )
    )  # fmt: skip


async def route_peers(server: ConfiguredServer) -> set[str]:
    return {r.get("remote_name", "") for r in (await server.monitor("/routez"))["routes"] or []}


def intruder_config(
    workdir: Path, route_ports: list[int], *, password: str, tls: dict[str, str] | None
) -> str:
    """A fourth server of the hub's cluster name whose routes dial every node's route port
    with `password` (none if empty), over `tls` (in the clear if None)."""
    creds = f"baton-route:{password}@" if password else ""
    routes = [f"nats-route://{creds}127.0.0.1:{p}" for p in route_ports]
    tls_block = f"  tls {json.dumps({**tls, 'verify': True})}\n" if tls else ""
    return (
        f'ports_file_dir: "{workdir}"\nlisten: 127.0.0.1:-1\nhttp: 127.0.0.1:-1\n'
        f"cluster {{\n  name: baton-hub\n  host: 127.0.0.1\n  port: -1\n{tls_block}"
        f"  routes: {json.dumps(routes)}\n}}\n"
    )


async def test_hub_node_routes_refuse_a_server_short_of_password_or_route_certificate(
    launch: Launch, tmp_path: Path
) -> None:
    """hub-node.conf's routes: a fourth server dialling the route ports without the route
    password, in the clear, or with the certificate sites trust (the WebSocket's, not one of
    the routes' CA) is refused each time and holds no route; the three stay one cluster."""
    from baton.stack.cluster import free_ports

    certs = tmp_path / "certs"
    ports = free_ports(len(HUB_NODES))
    hubs = await start_hub_nodes(launch, tmp_path, certs, ports)

    async def one_cluster() -> bool:
        try:
            peers = [await route_peers(h) for h in hubs]
            metas = [(await h.monitor("/jsz")).get("meta_cluster") or {} for h in hubs]
            leaders = {m.get("leader") for m in metas}
        except Exception:
            return False
        want = [set(HUB_NODES) - {n} for n in HUB_NODES]
        return peers == want and len(leaders) == 1 and leaders <= set(HUB_NODES)

    await wait_for(one_cluster, 30, "three nodes routed, one meta leader")
    password = node_env("hub-1", dict.fromkeys(HUB_NODES, 0))["BATON_PW_ROUTE"]
    node_cert = {  # hub-3's route certificate and key, as if stolen
        "cert_file": str(certs / "route-hub-3.pem"),
        "key_file": str(certs / "route-hub-3-key.pem"),
        "ca_file": str(certs / "route-ca.pem"),
    }
    site_cert = {  # the WebSocket's certificate: its CA is not the routes'
        "cert_file": str(certs / "hub.pem"),
        "key_file": str(certs / "hub-key.pem"),
        "ca_file": str(certs / "route-ca.pem"),
    }
    refused = {
        # name: (password, TLS, what the nodes log of each refusal)
        "no-password": ("", node_cert, "authentication error"),
        "no-tls": (password, None, "first record does not look like a TLS handshake"),
        "site-certificate": (password, site_cert, "TLS route handshake error"),
    }

    def logs() -> str:
        return "".join(h.log() for h in hubs)

    for name, (pw, tls, why) in refused.items():
        before = logs().count(why)
        workdir = tmp_path / name
        intruder = ConfiguredServer(
            name, intruder_config(workdir, ports, password=pw, tls=tls), workdir
        )
        try:
            await intruder.start()

            async def refused_twice(why: str = why, before: int = before) -> bool:
                return logs().count(why) >= before + 2

            await wait_for(refused_twice, 30, f"{name}: two refusals ({why!r})")

            # A dial being refused is listed at the intruder for a moment, between its
            # handshake and the node's refusal (long enough on a loaded machine to be
            # seen): what matters is that none is held, and that no node took it.
            async def holds_none(intruder: ConfiguredServer = intruder) -> bool:
                return await route_peers(intruder) == set()

            await wait_for(holds_none, 30, f"{name} to hold no route")
            assert await one_cluster(), f"{name} was taken into the cluster"
        finally:
            await intruder.stop()
    assert await one_cluster(), "the three nodes are no longer one cluster"
    assert password not in logs(), "the route password is logged"
