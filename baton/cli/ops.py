"""Operator commands: streams, checkpoints, dead letters, logs."""

from __future__ import annotations

import datetime
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import (
    Json,
    Server,
    Typer,
    app,
    err,
    fail,
    out,
    print_json,
    run,
    store_of,
    with_nats,
)

if TYPE_CHECKING:
    from baton.client import inspect
    from shared.contracts.events import Event

# As in `baton.cli.app`: each command imports NATS, the store and rich's tables itself.

Store = Annotated[str | None, typer.Option("--store", envvar="BATON_STORE", help="Store URL.")]
DEFAULT = "nats://127.0.0.1:4222"

dlq_app = Typer(help="Dead letters: list, show, replay.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


@app.command()
def streams(
    server: Server = DEFAULT,
    domain: Annotated[str | None, typer.Option(help="JetStream domain (a site's).")] = None,
    as_json: Json = False,
) -> None:
    """Baton's streams with their consumers: messages, bytes, pending, redeliveries."""
    from rich.table import Table

    from baton.client import inspect

    reports = run(lambda: with_nats(server, lambda nc: inspect.streams(nc, domain)))
    if as_json:
        print_json(reports)
        return
    t = Table(
        "stream",
        "messages",
        "bytes",
        "first",
        "last",
        "consumer",
        "pending",
        "ack pending",
        "redelivered",
        "waiting",
    )
    for r in reports:
        rows: list[inspect.ConsumerReport | None] = [*r.consumers] or [None]
        for i, c in enumerate(rows):
            head = [r.name, str(r.messages), _size(r.bytes), str(r.first_seq), str(r.last_seq)]
            if i:
                head = ["", "", "", "", ""]
            tail = (
                ["-"] * 5
                if c is None
                else [
                    c.name,
                    str(c.pending),
                    str(c.ack_pending),
                    str(c.redelivered),
                    str(c.waiting),
                ]
            )
            t.add_row(*head, *tail)
    out.print(t)


@app.command()
def sites(server: Server = DEFAULT, as_json: Json = False) -> None:
    """Sites the hub has heard from: link state, when the hub last heard each (its server's
    clock: the reaper's and this host's may be off), backlog (messages the hub has yet to
    take from the site's outbox, as last measured), the live runs granted to each, and
    their expected seconds still to train per live trainer there (its granted horizon)."""
    from rich.table import Table

    from baton.client.errors import needs
    from shared.bus import sourcing as site_links

    async def go(nc: Any) -> list[site_links.SiteView]:
        from baton.client.holdings import site_views

        with needs("sites bucket"):
            return await site_views(nc)

    found = run(lambda: with_nats(server, go))
    if as_json:
        print_json(found)
        return
    if not found:
        err.print("no site has greeted this hub yet (`baton up --site NAME --hub URL`)")
        return
    t = Table(
        "site", "link", "last seen", "backlog", "links", "outbox last seq", "runs held",
        "horizon / trainer",
    )  # fmt: skip
    for v in found:
        link = "[green]up[/green]" if v.link == "up" else "[red]down[/red]"
        horizon = f"{v.horizon_s:.0f}s" if v.horizon_s is not None else "-"
        if v.unestimated:
            horizon += f" (+{v.unestimated} unestimated)"
        t.add_row(
            v.site, link, f"{v.last_seen_s:.1f}s ago", str(v.backlog), str(v.links),
            str(v.outbox_last_seq), str(v.held), horizon,
        )  # fmt: skip
    out.print(t)


@app.command("auth-config")
def auth_config(
    site: Annotated[str | None, typer.Option(help="A site's leaf node instead of the hub.")] = None,
    sites: Annotated[str, typer.Option(help="At the hub: sites allowed to join, a,b,c.")] = "",
    submitter: Annotated[
        list[str] | None,
        typer.Option(help="At the hub: a person, its own submitter user (repeatable, or a,b)."),
    ] = None,
    passwords: Annotated[
        str | None,
        typer.Option(
            help="Include this file ahead of the block: the people's passwords as NATS "
            'variables (BATON_PW_ALICE: "…"), which a server re-reads on reload, unlike its '
            "environment (relative to the generated file)."
        ),
    ] = None,
) -> None:
    """Print the NATS `authorization` block of the hub or of a site: a user per role with
    its allow-lists, each password read from a NATS variable (BATON_PW_<USER>), which falls
    back to the environment. Include it from the server's config (deploy/nats/hub.conf
    does); a server that reloads it (`nats-server --signal reload`) lets new people in and
    closes the connections of those no longer there."""
    import json

    from baton.stack.people import check_person, inbox_of
    from shared import auth

    joining = tuple(s.strip() for s in sites.split(",") if s.strip())
    people = tuple(n.strip() for g in submitter or [] for n in g.split(",") if n.strip())
    if people and site:
        fail("--submitter is for the hub, not a site: a site has no people", code=2)
    try:
        for name in people:
            check_person(name)
    except ValueError as exc:
        fail(f"--submitter: {exc}", code=2)
    if len({inbox_of(n) for n in set(people)}) < len(set(people)):
        fail("--submitter: two people would share a reply inbox ('-' and '_' are one)", code=2)
    args = "".join(
        [f" --site {site}" if site else "", f" --sites {sites}" if joining else ""]
        + [f" --submitter {n}" for n in people]
        + [f" --passwords {passwords}" if passwords else ""]
    )
    header = f"# Generated by `baton auth-config{args}`; do not edit by hand.\n"
    if passwords:
        header += f"include {json.dumps(passwords)}\n"
    sys.stdout.write(header + auth.deployment_config(site, joining, people) + "\n")


@app.command()
def checkpoints(
    run_id: str,
    server: Server = DEFAULT,
    store: Store = None,
    pin: Annotated[int | None, typer.Option(help="Pin this step: retention keeps it.")] = None,
    as_json: Json = False,
) -> None:
    """Every checkpoint a run has stored, newest first: on the chain (what resumes), abandoned
    by a rollback (kept until garbage collection, never restored) or off it; pinned, final
    and latest ones marked."""
    from rich.table import Table

    from baton.client import inspect
    from shared.contracts.events import loss_of

    url = store_of(server, store)
    if pin is not None:
        run(lambda: inspect.pin(url, run_id, pin))
    rows = run(lambda: inspect.checkpoints(url, run_id))
    if as_json:
        print_json(rows)
        return
    t = Table("step", "token", "status", "worker", "size", "committed", "loss", "digest", "")
    for r in rows:
        flags = (("latest", r.latest), ("final", r.final), ("pinned", r.pinned))
        marks = " ".join(m for m, on in flags if on)
        loss = loss_of(r.metrics)
        t.add_row(
            str(r.step), str(r.token), r.status, r.worker, _size(r.bytes), _when(r.created_at),
            "-" if loss is None else f"{loss:.4g}", r.digest[:12] or "-", marks,
        )  # fmt: skip
    out.print(t)


@app.command()
def logs(
    run_id: str,
    server: Server = DEFAULT,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output.")
    ] = False,
    as_json: Json = False,
) -> None:
    """A run's events and its entry point's stdout/stderr (as its trainers captured them).
    With --json: one JSON object per line on stdout, each event as `watch --json` prints
    it, each piece of output as {"type": "output", "text": …}."""
    import asyncio
    import json

    from baton.client import calls as client
    from baton.client import inspect

    async def go(nc: Any) -> None:
        await client.record(nc, run_id)  # a clear error for an unknown run
        events = asyncio.create_task(_print_events(nc, run_id, follow, as_json))
        async for chunk in inspect.log_chunks(nc, run_id, follow):
            text = chunk.decode(errors="replace")
            line = json.dumps({"type": "output", "text": text}) + "\n"
            sys.stdout.write(line if as_json else text)
            sys.stdout.flush()
        await events

    try:
        run(lambda: with_nats(server, go))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


async def _print_events(nc: Any, run_id: str, follow: bool, as_json: bool) -> None:
    import json

    from baton.cli.watch import describe
    from baton.client.inspect import as_json as builtins
    from shared.contracts.events import Progress

    async for event in _events(nc, run_id, follow):
        if as_json:
            sys.stdout.write(json.dumps(builtins(event)) + "\n")
            sys.stdout.flush()
            continue
        if isinstance(event, Progress):
            continue
        line = describe(event) or type(event).__name__.lower()
        err.print(f"[dim]{_when(event.at)}[/dim] {line}")


async def _events(nc: Any, run_id: str, follow: bool) -> Any:
    from baton.client import calls as client

    if follow:
        async for e in client.events(nc, run_id):
            yield e
        return
    history: list[Event] = await client.history(nc, run_id)
    for e in history:
        yield e


@dlq_app.command("list")
def dlq_list(server: Server = DEFAULT, as_json: Json = False) -> None:
    """Every dead letter with its reason."""
    from rich.table import Table

    from baton.client import inspect

    letters = run(lambda: with_nats(server, inspect.dlq))
    if as_json:
        print_json(letters)
        return
    t = Table("#", "when", "from", "subject", "deliveries", "reason")
    for x in letters:
        L = x.letter
        t.add_row(str(x.seq), _when(L.at), L.source, L.subject, str(L.delivered), L.reason)
    out.print(t)


@dlq_app.command("show")
def dlq_show(seq: int, server: Server = DEFAULT, as_json: Json = False) -> None:
    """One dead letter, with its original message."""
    from baton.client import inspect

    x = run(lambda: with_nats(server, lambda nc: inspect.dlq_show(nc, seq)))
    if as_json:
        print_json(x)
        return
    L = x.letter
    for k, v in (("from", L.source), ("subject", L.subject), ("reason", L.reason),
                 ("deliveries", str(L.delivered)), ("when", _when(L.at))):  # fmt: skip
        out.print(f"[bold]{k}:[/bold] {v}")
    out.print(inspect.payload_text(L.payload), markup=False, highlight=False)


@dlq_app.command("replay")
def dlq_replay(seq: int, server: Server = DEFAULT, as_json: Json = False) -> None:
    """Publish a dead letter's message again to its subject, and remove the letter."""
    from baton.client import inspect

    subject = run(lambda: with_nats(server, lambda nc: inspect.dlq_replay(nc, seq)))
    if as_json:
        print_json({"replayed": seq, "subject": subject})
        return
    out.print(f"replayed #{seq} to {subject}")


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _when(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def ui(
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on: loopback unless you say otherwise. The dashboard "
            "answers to it, to the loopback names and to each --allow-host; bound to every "
            "address (0.0.0.0, ::), to any IP address too."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).")] = 8650,
    allow_host: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-host",
            metavar="NAME",
            help="Another name browsers reach the dashboard by (`name` or `name:port`; "
            "repeat for more): a request naming any other host is refused.",
        ),
    ] = None,
    server: Server = DEFAULT,
    store: Store = None,
) -> None:
    """Serve the live dashboard — runs, a run's loss and timeline, workers, sites, streams,
    dead letters — until Ctrl-C. It logs in to NATS as the `dashboard` role that `baton up`
    writes (./.baton/auth/dashboard.env: reads and replay only), else as the CLI does."""
    from baton.cli.common import DASHBOARD_AUTH_FILE, DEFAULT_AUTH_FILE, Connection, fail
    from baton.client import calls as client
    from baton.client.errors import CliError
    from baton.ui import server as dashboard
    from baton.ui import web

    try:  # the store only lists checkpoints: without one (nor the hub's), the rest works
        url: str | None = client.store_url(store)
    except CliError:
        url = None  # the dashboard asks the hub where it is (`shared.state.hub`)
    try:
        web.hosts_for(host, port or 1, allow_host or ())
    except CliError as exc:
        fail(str(exc), exc.code)
    if not web.loopback(host):
        err.print(
            f"[yellow]listening on {host}: whoever reaches it sees every run and may replay "
            "dead letters and pin checkpoints; the dashboard has no login of its own[/yellow]"
        )
    # Next to `baton up`: its dashboard user, or an older stack's operator.
    default = DASHBOARD_AUTH_FILE if DASHBOARD_AUTH_FILE.is_file() else DEFAULT_AUTH_FILE
    options = Connection.options(default)
    who = f"NATS user {options['user']}" if options.get("user") else "given NATS credentials"

    def ready(address: str) -> None:
        out.print(f"Baton dashboard on {address}  ({who}; Ctrl-C to stop)")
        sys.stdout.flush()

    async def go() -> None:
        nc = await client.open_nats(server, **options)
        try:
            await dashboard.serve(nc, url, host, port, ready, allow_host or ())
        finally:
            await nc.close()

    run(go)
