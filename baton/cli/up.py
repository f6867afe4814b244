"""`baton up`: the stack on this machine, a thin adapter over `baton.stack` — its options
grouped below by what they say of the stack (where it runs, a site, its authority, the hub's
cluster, the hub's files), checked before anything starts and handed on as one
`StackOptions` (`stack_options`) to `baton.stack.lifecycle.run_stack`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from baton.cli.common import app, fail

if TYPE_CHECKING:
    from baton.stack.options import StackOptions

# Where it runs, and how much.
DataDir = Annotated[Path, typer.Option(help="Where NATS, the store and logs live.")]
Port = Annotated[
    int | None,
    typer.Option(
        help="NATS client port on 127.0.0.1 (0: any free port, and so every other port "
        "the stack opens, unless named). \\[default: 4222, a site 4223]"
    ),
]
Trainers = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=64,
        help="Trainer processes to run, each on its own GPU while there are GPUs left. "
        "\\[default: one per GPU of this host, or 2 without one]",
    ),
]
Pool = Annotated[str, typer.Option(help="Pool the trainers serve.")]
LeaseTtl = Annotated[int | None, typer.Option(min=2, help="Lease TTL in seconds.")]
WsPort = Annotated[
    int | None,
    typer.Option(
        help="The hub's WebSocket port for sites, on 127.0.0.1 (0: any). "
        "\\[default: 8080; with --port 0, any free port, as for every port it opens]"
    ),
]

# A site, instead of the hub.
SiteName = Annotated[
    str | None, typer.Option(help="Run a site of this name (a leaf of --hub) instead.")
]
HubUrl = Annotated[
    str | None,
    typer.Option(help="A site's hub: its WebSocket URL, ws://… or wss://… (each node's, a,b,c)."),
]
StoreUrl = Annotated[
    str | None,
    typer.Option(help="Store URL (file:///… or s3://…); a site must name the hub's."),
]

# Its authority: users, sites, people, machines.
Auth = Annotated[
    bool,
    typer.Option(help="Users per role with least privilege; credentials in DATA_DIR/auth."),
]
Sites = Annotated[
    str,
    typer.Option(help="At the hub, with auth: comma-separated sites allowed to join."),
]
Submitters = Annotated[
    list[str] | None,
    typer.Option(
        help="At the hub, with auth: a person, its own submitter user (repeatable, or "
        "a,b), kept with the stack's people (`baton people`); its credentials in "
        "DATA_DIR/auth/NAME.env."
    ),
]
HubAuth = Annotated[
    Path | None,
    typer.Option(
        help="At a site, with auth: its link credentials, from the hub's "
        "DATA_DIR/auth/site-NAME.env."
    ),
]
Machines = Annotated[
    bool,
    typer.Option(
        "--machines",
        help="With auth: admit machines that join with a token (`baton token "
        "create [--site S]`, `baton join`), each with its own identity, revocable "
        "(docs/machines.md); runs the registrar. At a site (--site), machines join "
        "there and log in through cuts; the hub must admit machines too.",
    ),
]

# The hub's cluster.
HubNodes = Annotated[
    int,
    typer.Option(
        min=1,
        max=7,
        help="The hub as a cluster of this many nats-servers (3 survives the loss of "
        "any one); node N on PORT+N-1, WS_PORT+N-1, routes on PORT+2000+N-1 (free "
        "ones with --port 0); routes need a generated password and TLS.",
    ),
]
Replicas = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=5,
        help="Copies of each stream and bucket. \\[default: the nodes, up to 3]",
    ),
]

# The hub's files.
Alerts = Annotated[
    Path | None,
    typer.Option(
        help="At the hub: a TOML file of webhooks to notify when runs fail, stall, "
        "near their budget or a site is cut off; runs the notifier (docs/alerts.md).",
    ),
]
Pools = Annotated[
    Path | None,
    typer.Option(
        help="At the hub: the pools' table (priorities, owners' shares and quotas, "
        "prices: docs/scheduling.md), in force at once and again whenever the file "
        "changes.",
    ),
]


@app.command()
def up(
    data_dir: DataDir = Path(".baton"),
    port: Port = None,
    trainers: Trainers = None,
    pool: Pool = "default",
    lease_ttl: LeaseTtl = None,
    ws_port: WsPort = None,
    site: SiteName = None,
    hub: HubUrl = None,
    store: StoreUrl = None,
    auth: Auth = True,
    sites: Sites = "",
    submitter: Submitters = None,
    hub_auth: HubAuth = None,
    hub_nodes: HubNodes = 1,
    replicas: Replicas = None,
    alerts: Alerts = None,
    pools: Pools = None,
    machines: Machines = False,
) -> None:
    """Run the whole stack on this machine: NATS with JetStream, a file:// store, and every
    service as its own process — or, with --site NAME --hub URL, a site: a leaf NATS server
    that keeps working while its link to the hub is down, the site's checkpointer, and
    trainers. With --hub-nodes 3, the hub is three nats-servers in one JetStream cluster,
    each stream and bucket on all three: it keeps running through the loss of any one.
    Ctrl-C or SIGTERM stops everything it started."""
    import asyncio

    from baton.stack.lifecycle import run_stack

    opts = stack_options(
        data_dir=data_dir, port=port, trainers=trainers, pool=pool, lease_ttl=lease_ttl,
        ws_port=ws_port, site=site, hub=hub, store=store, auth=auth, sites=sites,
        submitter=submitter, hub_auth=hub_auth, hub_nodes=hub_nodes, replicas=replicas,
        alerts=alerts, pools=pools, machines=machines,
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run_stack(opts)))


def stack_options(
    *,
    data_dir: Path,
    port: int | None,
    trainers: int | None,
    pool: str,
    lease_ttl: int | None,
    ws_port: int | None,
    site: str | None,
    hub: str | None,
    store: str | None,
    auth: bool,
    sites: str,
    submitter: list[str] | None,
    hub_auth: Path | None,
    hub_nodes: int,
    replicas: int | None,
    alerts: Path | None,
    pools: Path | None,
    machines: bool,
) -> StackOptions:
    """`baton up`'s options, checked (a bad one stops it before anything starts, exit 2),
    as the stack's."""
    from baton.cli.people import submitters_for_up
    from baton.stack.options import StackOptions
    from shared.config import load

    if site is not None:
        _check_site(site, hub, store, auth, hub_auth)
        if hub_nodes != 1 or replicas is not None:
            fail("--hub-nodes and --replicas are for the hub, not a site", code=2)
    elif hub or hub_auth:
        fail("--hub and --hub-auth are for a site: add --site NAME", code=2)
    if machines and not auth:
        fail("--machines needs auth: machines join as users of their own", code=2)
    extra_env = _hub_files(site, alerts, pools)
    if replicas is not None and replicas > hub_nodes:
        fail(f"--replicas {replicas} needs at least as many --hub-nodes, not {hub_nodes}", code=2)
    joining = tuple(s.strip() for s in sites.split(",") if s.strip())
    for name in joining:
        try:
            load({"BATON_SITE": name})
        except Exception as exc:
            fail(f"--sites: {exc}", code=2)
    people = submitters_for_up(submitter or [], site, auth, data_dir)
    return StackOptions(
        data_dir=data_dir,
        port=port if port is not None else (4223 if site else 4222),
        trainers=trainers,
        pool=pool,
        lease_ttl=lease_ttl,
        ws_port=ws_port,
        site=site or "",
        hub_url=hub or "",
        store=store or "",
        auth=auth,
        sites=joining,
        submitters=people,
        hub_auth=str(hub_auth or ""),
        hub_nodes=hub_nodes,
        replicas=replicas,
        alerts=str(alerts.absolute()) if alerts is not None else "",
        extra_env=extra_env,
        machines=machines,
    )


def _hub_files(site: str | None, alerts: Path | None, pools: Path | None) -> dict[str, str]:
    """The hub's own files checked before anything starts (a bad one stops `baton up`
    naming the field), and the services' environment for the pools' table."""
    for given, flag in ((alerts, "--alerts"), (pools, "--pools")):
        if given is not None and site is not None:
            fail(f"{flag} is for the hub, not a site", code=2)
    if alerts is not None:
        _check_alerts(alerts)
    return {"BATON_POOLS_FILE": _checked_pools(pools)} if pools is not None else {}


def _checked_pools(path: Path) -> str:
    """The pools' table's path, once it reads as one: a bad file stops `baton up` naming
    the field, before anything starts."""
    from shared.errors import ConfigError
    from shared.state.policy import load_table

    try:
        load_table(str(path))
    except ConfigError as exc:
        fail(str(exc), code=2)
    return str(path.absolute())


def _check_alerts(path: Path) -> None:
    """The notifier's own reading of the alerts file, before anything starts: a bad one
    stops `baton up` naming the key. Asked of the notifier in a process of its own, since
    the CLI imports no service's modules."""
    import os
    import subprocess

    from baton.stack.services import _pythonpath

    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    argv = [sys.executable, "-m", "services.notifier", "--check", str(path.absolute())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = done.stderr.strip().removeprefix("error: ") or f"exit status {done.returncode}"
        fail(f"--alerts: {said}", code=2)


def _check_site(
    site: str, hub: str | None, store: str | None, auth: bool, hub_auth: Path | None
) -> None:
    """What `baton up --site` needs before anything starts."""
    from shared.config import load

    try:
        load({"BATON_SITE": site})
    except Exception as exc:
        fail(str(exc), code=2)
    urls = [u.strip() for u in (hub or "").split(",")]
    if not hub or not all(u.startswith(("ws://", "wss://")) for u in urls):
        fail(
            "a site needs --hub ws://HOST:PORT (the URL `baton up` printed; a clustered "
            "hub's every node, comma-separated)",
            code=2,
        )
    if not store:
        fail("a site needs --store, the hub's store (it resumes the hub's runs)", code=2)
    if auth and (hub_auth is None or not hub_auth.is_file()):
        fail(
            f"a site needs --hub-auth FILE: the link credentials the hub generated for it "
            f"(`baton up --sites {site}` writes them to <hub data>/auth/site-{site}.env), "
            "or --no-auth on both",
            code=2,
        )


