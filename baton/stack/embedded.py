"""`baton up`: the whole stack on one machine — or one site of it.

An embedded nats-server (JetStream, loopback only), a `file://` store, and the services as
supervised child processes: dispatcher, checkpointer, reaper and N trainers. The server is
the hub (JetStream domain `hub`) and listens for sites on a WebSocket port.

With `site`, it is a site instead: a leaf nats-server in the site's own domain that dials
the hub's WebSocket, the site's checkpointer, and N trainers that take the hub's work. A site
shares the hub's store (`store`), since either may resume the other's runs.

Everything lives under one data directory:

    <data>/nats   server config, log and JetStream store
    <data>/store  checkpoints (the `file://` object store)
    <data>/logs   one log per service
    <data>/run    pid files, `stack.json` (present while the stack runs), `stack.lock`
    <data>/work   per-trainer scratch
    <data>/auth   generated NATS credentials, one owner-only file per user
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import IO, Any

import msgspec

from baton.stack.cluster import ROUTE_PORT_OFFSET, HubCluster, data_dir
from baton.stack.natsconf import hub_fragment, leaf_fragment
from baton.stack.natsserver import ClusterRoutes, NatsServer, NatsServerError
from baton.stack.people import People
from baton.stack.procs import (
    SERVICE_GRACE_S,
    TRAINER_GRACE_S,
    ServiceSpec,
    StopGroup,
    Supervisor,
    install_stop_signals,
    remove_stop_signals,
)
from baton.stack.routes import RouteAuth
from shared import gpus
from shared.auth import (
    DEPARTURES_USER,
    HUB_ROLES,
    SITE_ROLES,
    SYSTEM_USER,
    authorization,
    hub_permissions,
    registrar_permissions,
    site_link,
    site_permissions,
    site_registrar_permissions,
    submitter_permissions,
    system_users,
)
from shared.bus import names
from shared.config import Settings
from shared.credentials import Vault, options_for, read_env_file
from shared.gpus import Gpu
from shared.machines.callout import issuer_public, new_issuer_seed

log = logging.getLogger("baton.stack")

# The server must outlive every service's shutdown (trainers commit through it), so it only
# gets its own, short, grace once they are all gone.
NATS_STOP_TIMEOUT_S = 10.0
# What the trainers take by default; TRAINER_GRACE_S is that plus a margin.
DEFAULT_TRAINER_CHECKPOINT_S: float = Settings().grace_s
CPU_TRAINERS = 2
"""Trainers `baton up` runs on a host without a GPU (one per GPU where there are some)."""
DEFAULT_WS_PORT = 8080
"""The hub's WebSocket port for sites when the client port is a fixed one."""
# A crash-looping server gets the same patience as a crash-looping service.
NATS_RESTART_DELAY_S = 1.0
# A clustered hub's stream stops taking writes for up to ~10 s while it elects a leader in
# place of a lost one (docs/architecture.md, "A clustered hub"); a lease renewed every
# third of its TTL must outlast that gap plus a renewal interval: 10 + 30/3 < 30.
CLUSTER_LEASE_TTL = 30

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


class StackOptions(msgspec.Struct, kw_only=True):
    data_dir: Path = Path(".baton")
    port: int = 4222
    """0: any free port."""
    trainers: int | None = None
    """None: one per GPU in `gpus`, or `CPU_TRAINERS` on a host without one."""
    pool: str = "default"
    lease_ttl: int | None = None
    """Seconds; None leaves the services' default (`BATON_LEASE_TTL`), or on a clustered
    hub `CLUSTER_LEASE_TTL`."""
    extra_env: dict[str, str] = {}
    """Laid over every service's environment, after Baton's own variables."""
    ws_port: int | None = None
    """The hub's WebSocket port for sites, on 127.0.0.1 (0: any free port); None:
    `DEFAULT_WS_PORT`, or any free port when `port` is 0 (`hub_ws_port`)."""
    site: str = ""
    """Run a site of this name instead of the hub."""
    hub_url: str = ""
    """A site's way to the hub: its WebSocket URL (`ws://…` or `wss://…`)."""
    store: str = ""
    """The store URL; default `file://<data_dir>/store`. A site must name the hub's."""
    auth: bool = True
    """Users per role with least privilege (`shared.auth`); passwords generated into
    `<data_dir>/auth`, owner-only."""
    sites: tuple[str, ...] = ()
    """At the hub, with auth: the sites allowed to join (each gets a link user)."""
    submitters: tuple[str, ...] = ()
    """At the hub, with auth: submitter users besides `submitter`, each owning its runs —
    the stack's people (`baton.stack.people`): `run_stack` adds these to
    `<data_dir>/auth/people.json` and runs with everyone listed there."""
    hub_auth: str = ""
    """At a site, with auth: the file holding the site's link credentials, which the hub
    generated (`<hub data>/auth/site-<name>.env`)."""
    hub_nodes: int = 1
    """The hub's nats-servers, one JetStream cluster (`baton.stack.cluster`). Node N (from
    1) listens on `port + N - 1`, `ws_port + N - 1` and routes on `port + 2000 + N - 1`
    (any free ports when `port` is 0); its state is under `<data>/nats/hub-N`. Routes need
    the cluster's password and certificates (`RouteAuth.in_vault`)."""
    replicas: int | None = None
    """Copies of every stream and bucket (`BATON_REPLICAS`); None: as many as there are
    nodes, up to 3 — the most a single machine's loss asks for."""
    alerts: str = ""
    """At the hub: the alerts file (docs/alerts.md); with one, the notifier runs too, and
    reads it from `BATON_ALERTS`."""
    machines: bool = False
    """At the hub, with auth: admit machines that join with a token (`baton token create`,
    `baton join`), each as itself: the registrar runs, and the hub's servers ask it about
    every user they do not know themselves (docs/machines.md)."""

    gpus: list[Gpu] | None = None
    """The GPUs the trainers are spread over, one each (round-robin when there are more
    trainers than GPUs), each pinned by `CUDA_VISIBLE_DEVICES`; None: those of this host
    that this process's own `CUDA_VISIBLE_DEVICES` allows (`shared.gpus`)."""

    @property
    def hub_ws_port(self) -> int:
        """`port` 0 makes every port the stack opens a free one unless named: two stacks
        on one machine never collide (the URLs are in the banner and `run/stack.json`)."""
        if self.ws_port is not None:
            return self.ws_port
        return DEFAULT_WS_PORT if self.port else 0

    @property
    def stream_replicas(self) -> int:
        return self.replicas if self.replicas is not None else min(3, self.hub_nodes)

    @property
    def lease_ttl_s(self) -> int | None:
        if self.lease_ttl is None and self.hub_nodes > 1 and not self.site:
            return CLUSTER_LEASE_TTL
        return self.lease_ttl


SpecBuilder = Callable[[StackOptions, str], list[ServiceSpec]]


def service_specs(opts: StackOptions, nats_url: str) -> list[ServiceSpec]:
    """Dispatcher, checkpointer, reaper (and the notifier, given an alerts file) and the
    trainers, in start order; at a site, its checkpointer, its dispatcher (of the jobs
    submitted there) and trainers (named after the site: worker names are unique
    system-wide)."""
    data = opts.data_dir.absolute()
    trainer = f"{opts.site}-trainer" if opts.site else "trainer"
    hub_services = ["dispatcher", "checkpointer", "reaper"]
    services = ["checkpointer", "dispatcher"] if opts.site else hub_services
    if opts.alerts and not opts.site:
        services.append("notifier")
    if admits_machines(opts):
        services.append("registrar")
    usable = devices(opts)
    trainers = [f"{trainer}-{i}" for i in range(1, trainer_count(opts, usable) + 1)]
    # Trainer N's training processes get GPU N (round-robin past the last one).
    pinned = {t: gpus.pin(usable[i % len(usable)]) for i, t in enumerate(trainers) if usable}
    specs = []
    for name in services + trainers:
        module = "services.trainer" if _is_trainer(name) else f"services.{name}"
        env = {
            "NATS_URL": nats_url,
            "BATON_STORE": store_url(opts),
            "BATON_WORK_DIR": str(data / "work" / name),
            "BATON_WORKER_ID": name,
            "BATON_POOL": opts.pool,
            "PYTHONUNBUFFERED": "1",
        }
        if pythonpath := _pythonpath():
            env["PYTHONPATH"] = pythonpath
        if opts.lease_ttl_s is not None:
            env["BATON_LEASE_TTL"] = str(opts.lease_ttl_s)
        if not opts.site and opts.stream_replicas != 1:
            env["BATON_REPLICAS"] = str(opts.stream_replicas)
        if opts.site:
            env["BATON_SITE"] = opts.site
        if name == "notifier":
            env["BATON_ALERTS"] = str(Path(opts.alerts).absolute())
        env.update(pinned.get(name, {}))
        if (v := vault(opts)) is not None:
            env.update(_credentials(opts, v, name))
        env.update(opts.extra_env)
        # The user's cwd, so that entry points `module:function` next to them import.
        specs.append(
            ServiceSpec(name=name, argv=[sys.executable, "-m", module], env=env, cwd=os.getcwd())
        )
    return specs


def _credentials(opts: StackOptions, v: Vault, name: str) -> dict[str, str]:
    """Where service `name` finds its credentials: files, never the secrets themselves
    (the environment is copied to more places)."""
    user = user_of(opts, "trainer" if _is_trainer(name) else name)
    v.get(user)
    env = {"NATS_AUTH_FILE": str(v.root / f"{user}.env")}
    if name in ("dispatcher", "reaper"):
        # They key the runs' leases (shared/state/lease.py); no one else may know how.
        env["BATON_LEASE_SECRET_FILE"] = str(v.secret("lease"))
    if name == "reaper" and not opts.site:
        # It hears trainers' connections close (services/reaper/departures.py).
        v.get(DEPARTURES_USER)
        env["BATON_DEPARTURES_AUTH_FILE"] = str(v.root / f"{DEPARTURES_USER}.env")
    if name == "registrar":
        # It signs the callout's answers, and closes revoked machines' connections.
        env["BATON_CALLOUT_SEED_FILE"] = str(callout_seed(v))
        v.get(SYSTEM_USER)
        env["BATON_SYSTEM_AUTH_FILE"] = str(v.root / f"{SYSTEM_USER}.env")
        if not opts.site:  # a site has no people
            env["BATON_PEOPLE_DIR"] = str(v.root)
    return env


def devices(opts: StackOptions) -> list[Gpu]:
    """The GPUs the stack's trainers are spread over (`StackOptions.gpus`)."""
    return opts.gpus if opts.gpus is not None else gpus.visible(gpus.host_gpus(), os.environ)


def trainer_count(opts: StackOptions, usable: list[Gpu]) -> int:
    if opts.trainers is not None:
        return opts.trainers
    return len(usable) or CPU_TRAINERS


def _pythonpath() -> str:
    """Run from a checkout that is not pip-installed, the services must still import from
    the same tree as this module. (`-m` puts the cwd first, so user entry points win.)"""
    root = Path(__file__).resolve().parents[1]
    parts = [str(root)] if (root / "services" / "__init__.py").is_file() else []
    if existing := os.environ.get("PYTHONPATH"):
        parts.append(existing)
    return os.pathsep.join(parts)


def store_url(opts: StackOptions) -> str:
    return opts.store or f"file://{opts.data_dir.absolute() / 'store'}"


def _is_trainer(name: str) -> bool:
    return "trainer-" in name


def vault(opts: StackOptions) -> Vault | None:
    return Vault(opts.data_dir.absolute() / "auth") if opts.auth else None


def user_of(opts: StackOptions, role: str) -> str:
    """The NATS user a role connects as: the role at the hub, `<site>-<role>` at a site."""
    return f"{opts.site}-{role}" if opts.site else role


def operator_options(opts: StackOptions) -> dict[str, Any]:
    """Client options for the stack's operator (none without auth)."""
    v = vault(opts)
    return options_for(v.get(user_of(opts, "operator"))) if v else {}


def admits_machines(opts: StackOptions) -> bool:
    """Whether the hub (or the site) admits machines through its registrar."""
    return opts.machines and opts.auth


def callout_seed(v: Vault) -> Path:
    """The account key the registrar signs the callout's answers with; the servers know
    its public half (`shared.machines.callout`)."""
    return v.secret("callout", lambda: new_issuer_seed().decode())


def _authorization(opts: StackOptions, v: Vault) -> str:
    if opts.site:
        site = [(v.get(user_of(opts, r)), site_permissions(r, opts.site)) for r in SITE_ROLES]
        if not admits_machines(opts):
            return authorization(site)
        # Machines that joined at the site log in here, through its own registrar.
        site.append((v.get(user_of(opts, "registrar")), site_registrar_permissions(opts.site)))
        issuer = issuer_public(callout_seed(v).read_bytes().strip())
        return authorization(site, [(v.get(SYSTEM_USER), None)], issuer)
    users = [(v.get(r), hub_permissions(r)) for r in HUB_ROLES]
    users += [(v.get(u), submitter_permissions(u)) for u in opts.submitters]
    users += [(v.get(f"site-{s}"), site_link(s)) for s in opts.sites]
    if not admits_machines(opts):
        return authorization(users, system_users(v.get(DEPARTURES_USER)))
    users.append((v.get("registrar"), registrar_permissions()))
    issuer = issuer_public(callout_seed(v).read_bytes().strip())
    # The people are asked of the registrar too: the servers' `auth_users` cannot change
    # while they run, and the people do.
    bypass = [c.user for c, _ in users if c.user not in opts.submitters]
    system = system_users(v.get(DEPARTURES_USER), v.get(SYSTEM_USER))
    return authorization(users, system, issuer, bypass)


def _hub_config(opts: StackOptions, v: Vault | None) -> str:
    """What every hub node's config adds to the server's own settings."""
    return hub_fragment() + "\n" + (_authorization(opts, v) if v else "")


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
        auth = _authorization(opts, v) if v else ""
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
            extra_config=_hub_config(opts, v), stop_timeout_s=stop_timeout_s,
            http_port=http_port, probe=probe, sync_interval=single_node_sync(),
        )  # fmt: skip
    return NatsServer(
        data_dir(data / "nats", node), port=_nth(opts.port, node), server_name=f"hub-{node + 1}",
        domain=names.HUB_DOMAIN, ws_port=_nth(opts.hub_ws_port, node), cluster=routes,
        extra_config=_hub_config(opts, v), stop_timeout_s=stop_timeout_s,
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


def has_people(opts: StackOptions) -> bool:
    """Only the hub with auth has people: a site has none, a stack without auth no users."""
    return opts.auth and not opts.site


async def reload_people(opts: StackOptions, server: HubCluster) -> StackOptions:
    """Build the hub's authorization again from the people there are now, and have every
    node reload it (a node down now starts with it); returns the options it was built
    from. The servers close a removed person's connections themselves. Names and
    credentials are read under the people's lock: none is half added or half removed.

    On a hub that admits machines nothing is reloaded: the registrar admits the people
    from their file at every login, and a reload would have the servers ask it again
    about every connection at once — a machine's or person's whose answer comes late is
    closed (measured beside CPU hogs). A removed person's connections are closed through
    the system account instead."""
    people = People(opts.data_dir)
    before = set(opts.submitters)
    with people.locked():
        opts = msgspec.structs.replace(opts, submitters=tuple(people.names()))
        config = _hub_config(opts, vault(opts))
    if not admits_machines(opts):
        await server.reload(config)
    elif gone := sorted(before - set(opts.submitters)):
        await _close_people(opts, server.url, gone)
    return opts


async def _close_people(opts: StackOptions, url: str, gone: list[str]) -> None:
    """Close removed people's connections on a hub that admits machines, where the registrar
    admitted them (`shared.machines.connections`)."""
    from shared.bus.connect import connect
    from shared.machines.connections import close_all

    v = vault(opts)
    assert v is not None
    nc = await connect(url, "baton-up-system", first_attempt_timeout=10,
                       options=options_for(v.get(SYSTEM_USER)))  # fmt: skip
    try:
        for person in gone:
            await close_all(nc, person)
    finally:
        await nc.close()


def _with_people(opts: StackOptions) -> StackOptions:
    """At start: `opts.submitters` added to the people, and the stack run with them all."""
    if not has_people(opts):
        return opts
    return msgspec.structs.replace(opts, submitters=People(opts.data_dir).adding(opts.submitters))


def _catch_up(opts: StackOptions, reload: asyncio.Event) -> None:
    """Once `stack.json` tells `baton people` whom to signal: a reload if the people changed
    while the stack started, when no one knew it."""
    if has_people(opts) and People(opts.data_dir).changed_from(opts.submitters):
        reload.set()


async def _on_sighup(opts: StackOptions, server: HubCluster) -> StackOptions:
    """`reload_people`, saying what came of it on stderr (the stack goes on either way)."""
    if not has_people(opts):
        print("SIGHUP: this stack has no people to reload", file=sys.stderr, flush=True)
        return opts
    try:
        opts = await reload_people(opts, server)
    except (ValueError, OSError, NatsServerError) as exc:
        print(f"error: the people were not reloaded: {exc}", file=sys.stderr, flush=True)
        return opts
    people = ", ".join(opts.submitters) or "none"
    how = "the registrar admits them" if admits_machines(opts) else "every hub node reloaded"
    print(f"people: {people} ({how})", file=sys.stderr, flush=True)
    return opts


def _nth(port: int, node: int) -> int:
    """Node `node`'s port: the next ones after a fixed first port; 0 (any) stays 0."""
    return port + node if port else 0


def _with_user(url: str, user: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"


def stop_order(specs: list[ServiceSpec]) -> list[StopGroup]:
    """Trainers first: on SIGTERM each checkpoints its run, and committing that checkpoint
    needs NATS and a live checkpointer, so those must still be there. Then the dispatcher and
    the checkpointer, which by then have nothing left to serve. (The NATS server goes last,
    after the supervisor is done.)"""
    trainers = [s for s in specs if _is_trainer(s.name)]
    others = [s.name for s in specs if not _is_trainer(s.name)]
    grace = max([TRAINER_GRACE_S, *(_trainer_grace(s) for s in trainers)])
    return [StopGroup([s.name for s in trainers], grace), StopGroup(others, SERVICE_GRACE_S)]


def _trainer_grace(spec: ServiceSpec) -> float:
    """A trainer told (by `BATON_GRACE`) to take longer than the default to checkpoint must
    not be SIGKILLed by us before its own deadline."""
    raw = spec.env.get("BATON_GRACE", os.environ.get("BATON_GRACE"))
    try:
        return float(raw) + TRAINER_GRACE_S - DEFAULT_TRAINER_CHECKPOINT_S if raw else 0.0
    except ValueError:
        return 0.0


async def run_stack(
    opts: StackOptions,
    *,
    stop: asyncio.Event | None = None,
    hurry: asyncio.Event | None = None,
    build_specs: SpecBuilder = service_specs,
    out: IO[str] | None = None,
    reload: asyncio.Event | None = None,
) -> int:
    """Run the stack until SIGINT/SIGTERM, or until `stop` is set when one is given (then no
    signal handlers are installed, `hurry` plays the second signal and `reload` SIGHUP). A
    second signal skips the grace periods. SIGHUP reloads the people (`reload_people`).
    Returns the exit status for the CLI: 0 after a clean stop, 1 when the stack could not
    start or lost its NATS server for good."""
    out = out if out is not None else sys.stdout
    # Ask nvidia-smi once: the trainers' specs and the banner both need the GPUs.
    opts = msgspec.structs.replace(opts, gpus=devices(opts))
    data = opts.data_dir.absolute()
    for sub in ("nats", "store", "logs", "run", "work"):
        (data / sub).mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(data / "run" / "stack.lock")
    except BlockingIOError:
        print(f"error: a stack is already running on {data}", file=sys.stderr, flush=True)
        return 1
    try:
        opts = _with_people(opts)
    except (ValueError, OSError) as exc:
        lock.close()
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1

    loop = asyncio.get_running_loop()
    hurry = hurry if hurry is not None else asyncio.Event()
    reload = reload if reload is not None else asyncio.Event()
    own_signals = stop is None
    stop = stop if stop is not None else asyncio.Event()
    if own_signals:
        install_stop_signals(loop, stop, hurry)
        loop.add_signal_handler(signal.SIGHUP, reload.set)  # only state, as for the others

    server = hub(opts, NATS_STOP_TIMEOUT_S)
    supervisor = Supervisor(data / "logs", data / "run")

    async def reloading() -> None:
        nonlocal opts
        opts = await _on_sighup(opts, server)

    specs: list[ServiceSpec] = []
    stack_json = data / "run" / "stack.json"
    try:
        try:
            await server.start()
            specs = build_specs(opts, server.url)
            await supervisor.start_all(specs)
        except (NatsServerError, OSError) as exc:
            print(f"error: the stack did not start: {exc}", file=sys.stderr, flush=True)
            return 1
        if build_specs is service_specs:  # Baton's own services, which declare the streams
            await _until_declared(opts, server.url)
        # Every node's: a site's leaf given them all keeps its link through any one's loss.
        sites_url = ",".join(server.ws_urls)
        _write_json(
            stack_json,
            {
                "nats_url": server.url,
                "site": opts.site,
                "auth": opts.auth,
                "sites_url": sites_url,
                "store_url": store_url(opts),
                "pids": {"supervisor": os.getpid(), **server.pids, **supervisor.pids()},
                "started_at": time.time(),
            },
        )
        _banner(opts, server, sites_url, out)
        print(f"logs: {data / 'logs'}", file=out, flush=True)
        _catch_up(opts, reload)
        try:
            await _serve(server, stop, reload, reloading)
            print(
                "stopping: trainers first, to let them checkpoint (signal again to skip)",
                file=sys.stderr,
                flush=True,
            )
        except NatsServerError as exc:
            print(f"error: nats-server could not be restarted: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        await _uncancellable(_shutdown(supervisor, server, specs, hurry))
        with contextlib.suppress(FileNotFoundError):
            stack_json.unlink()
        if own_signals:
            remove_stop_signals(loop)
            loop.remove_signal_handler(signal.SIGHUP)
        lock.close()


READY_S = 60.0


async def _until_declared(opts: StackOptions, url: str) -> None:
    """Until the services have declared the stream a client's first publish goes to (the
    hub's submissions, a site's outbox) — and, on a hub that admits machines, until the
    registrar answers — so that the banner's URL is ready for `baton submit`. At most
    `READY_S`: a service that cannot start says why in its log, and the supervisor keeps
    restarting it meanwhile."""
    from nats.errors import Error as NatsError
    from nats.js.errors import Error as JetStreamError

    from shared.bus.connect import connect

    stream = names.OUTBOX_STREAM if opts.site else names.SUBMIT_STREAM
    deadline = time.monotonic() + READY_S
    nc = await connect(url, "baton-up", first_attempt_timeout=10, options=operator_options(opts))
    try:
        while time.monotonic() < deadline:
            try:
                await nc.jetstream().stream_info(stream)
                if admits_machines(opts):
                    # The people log in through it: the banner waits for it too.
                    await nc.request(names.REGISTRAR_HELLO, b"", timeout=2)
                return
            except (JetStreamError, NatsError, TimeoutError):
                await asyncio.sleep(0.2)
        print(f"warning: {stream} is not declared yet; see the logs", file=sys.stderr, flush=True)
    finally:
        await nc.close()


def _banner(opts: StackOptions, server: HubCluster, sites_url: str, out: IO[str]) -> None:
    """What `baton up` says it started, before its log directory."""
    print(f"nats: {server.url}", file=out)
    if len(server.nodes) > 1:
        print(
            f"hub: {len(server.nodes)} nodes, streams and buckets on "
            f"{opts.stream_replicas} of them",
            file=out,
        )
    if opts.site:
        print(f"site: {opts.site} (leaf of {opts.hub_url})", file=out)
    else:
        print(f"sites join at: {sites_url}", file=out)
    print(f"store: {store_url(opts)}", file=out)
    if usable := devices(opts):
        listed = ", ".join(f"{g.index} ({g.name})" for g in usable)
        print(f"gpus: {listed}; each trainer pinned to one, in turn", file=out)
    if (v := vault(opts)) is not None:
        ui = "" if opts.site else "; `baton ui`'s: dashboard.env"
        print(f"auth: on; credentials in {v.root} (the CLI's: operator.env{ui})", file=out)
    if admits_machines(opts):
        print("machines: admitted with a token (`baton token create`, then `baton join`)",
              file=out)  # fmt: skip


async def _serve(
    server: HubCluster,
    stop: asyncio.Event,
    reload: asyncio.Event | None = None,
    reloading: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Wait for the stop request; bring a server back if it dies meanwhile, since the
    services only reconnect to it, they cannot replace it. (A node of a cluster comes back
    on its store and catches up from its peers.) When `reload` is set, `reloading()` —
    here, between restarts, never during one: a server sent SIGHUP before it has set up its
    own signal handling would die of it."""
    reload = reload if reload is not None else asyncio.Event()
    stopping = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set():
            died = asyncio.create_task(server.wait_any())
            asked = asyncio.create_task(reload.wait())
            await asyncio.wait([stopping, died, asked], return_when=asyncio.FIRST_COMPLETED)
            asked.cancel()
            if stop.is_set() or reload.is_set():
                died.cancel()
            if stop.is_set():
                break
            if reload.is_set():
                reload.clear()  # before the reload reads: a later request is not lost
                if reloading is not None:
                    await reloading()
                continue
            node = died.result()
            log.warning(
                "nats-server %s exited with %s; restarting it", node.server_name, node.returncode
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), NATS_RESTART_DELAY_S)
            if not stop.is_set():
                await node.start()
    finally:
        stopping.cancel()


async def _shutdown(
    supervisor: Supervisor, server: HubCluster, specs: list[ServiceSpec], hurry: asyncio.Event
) -> None:
    try:
        await supervisor.stop(stop_order(specs), hurry=hurry)
    finally:
        if hurry.is_set():
            await server.kill()
        else:
            await server.stop()


async def _uncancellable(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to its end even if our caller is cancelled meanwhile (an interrupted
    shutdown is exactly how orphans are made), then pass the cancellation on."""
    task = asyncio.create_task(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


def hold_lock(path: Path) -> IO[str]:
    """Two stacks on one data dir would share a JetStream store and the pid files. A lock,
    not a pid check, because the kernel drops it when its holder dies, even by SIGKILL."""
    fh = open(path, "a")  # noqa: SIM115 - held open for as long as the stack runs
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        fh.close()
        raise
    return fh


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)
