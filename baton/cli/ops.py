"""Operator commands: streams, checkpoints, dead letters, logs."""

from __future__ import annotations

import asyncio
import datetime
import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from baton.cli import client, inspect
from baton.cli.common import Json, Server, app, call, err, out, print_json, run, with_nats
from baton.cli.watch import describe
from shared.contracts.events import Event, Progress

Store = Annotated[str | None, typer.Option("--store", envvar="BATON_STORE", help="Store URL.")]
DEFAULT = "nats://127.0.0.1:4222"

dlq_app = typer.Typer(help="Dead letters: list, show, replay.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


@app.command()
def streams(
    server: Server = DEFAULT,
    domain: Annotated[str | None, typer.Option(help="JetStream domain (a site's).")] = None,
    as_json: Json = False,
) -> None:
    """Baton's streams with their consumers: messages, bytes, pending, redeliveries."""
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
    """Sites the hub has heard from: link state, last greeting, and backlog (messages the
    hub has yet to take from the site's outbox, as last measured)."""
    from shared import sites as site_links

    found = run(lambda: with_nats(server, site_links.views))
    if as_json:
        print_json(found)
        return
    if not found:
        err.print("no site has greeted this hub yet (`baton up --site NAME --hub URL`)")
        return
    t = Table("site", "link", "last seen", "backlog", "links", "outbox last seq")
    for v in found:
        link = "[green]up[/green]" if v.link == "up" else "[red]down[/red]"
        t.add_row(
            v.site, link, f"{v.last_seen_s:.1f}s ago", str(v.backlog), str(v.links),
            str(v.outbox_last_seq),
        )  # fmt: skip
    out.print(t)


@app.command()
def checkpoints(
    run_id: str,
    store: Store = None,
    pin: Annotated[int | None, typer.Option(help="Pin this step: retention keeps it.")] = None,
    as_json: Json = False,
) -> None:
    """A run's committed checkpoints, newest first (pinned and final ones marked)."""
    url = run(lambda: call(client.store_url, store))
    if pin is not None:
        run(lambda: inspect.pin(url, run_id, pin))
    rows = run(lambda: inspect.checkpoints(url, run_id))
    if as_json:
        print_json(rows)
        return
    t = Table("step", "token", "worker", "size", "committed", "loss", "")
    for r in rows:
        marks = " ".join(m for m, on in (("final", r.final), ("pinned", r.pinned)) if on)
        loss = r.metrics.get("loss")
        t.add_row(
            str(r.step), str(r.token), r.worker, _size(r.bytes), _when(r.created_at),
            "-" if loss is None else f"{loss:.4g}", marks,
        )  # fmt: skip
    out.print(t)


@app.command()
def logs(
    run_id: str,
    server: Server = DEFAULT,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new output.")
    ] = False,
) -> None:
    """A run's events and its entry point's stdout/stderr (as its trainers captured them)."""

    async def go(nc: Any) -> None:
        await client.record(nc, run_id)  # a clear error for an unknown run
        events = asyncio.create_task(_print_events(nc, run_id, follow))
        async for chunk in inspect.log_chunks(nc, run_id, follow):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        await events

    try:
        run(lambda: with_nats(server, go))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


async def _print_events(nc: Any, run_id: str, follow: bool) -> None:
    async for event in _events(nc, run_id, follow):
        if isinstance(event, Progress):
            continue
        line = describe(event) or type(event).__name__.lower()
        err.print(f"[dim]{_when(event.at)}[/dim] {line}")


async def _events(nc: Any, run_id: str, follow: bool) -> Any:
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
def dlq_replay(seq: int, server: Server = DEFAULT) -> None:
    """Publish a dead letter's message again to its subject, and remove the letter."""
    subject = run(lambda: with_nats(server, lambda nc: inspect.dlq_replay(nc, seq)))
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
