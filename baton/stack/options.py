"""What a stack is: the options of `baton up` (`StackOptions`), and what follows from them
alone — the GPUs its trainers use, its store, its users and whether it admits machines."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from shared import gpus
from shared.credentials import Vault, options_for
from shared.gpus import Gpu

CPU_TRAINERS = 2
"""Trainers `baton up` runs on a host without a GPU (one per GPU where there are some)."""

DEFAULT_WS_PORT = 8080
"""The hub's WebSocket port for sites when the client port is a fixed one."""

# A clustered hub's stream stops taking writes for up to ~10 s while it elects a leader in
# place of a lost one (docs/architecture.md, "A clustered hub"); a lease renewed every
# third of its TTL must outlast that gap plus a renewal interval: 10 + 30/3 < 30.
CLUSTER_LEASE_TTL = 30


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


def devices(opts: StackOptions) -> list[Gpu]:
    """The GPUs the stack's trainers are spread over (`StackOptions.gpus`)."""
    return opts.gpus if opts.gpus is not None else gpus.visible(gpus.host_gpus(), os.environ)


def trainer_count(opts: StackOptions, usable: list[Gpu]) -> int:
    if opts.trainers is not None:
        return opts.trainers
    return len(usable) or CPU_TRAINERS


def store_url(opts: StackOptions) -> str:
    return opts.store or f"file://{opts.data_dir.absolute() / 'store'}"


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


def has_people(opts: StackOptions) -> bool:
    """Only the hub with auth has people: a site has none, a stack without auth no users."""
    return opts.auth and not opts.site
