"""Machines with identities of their own (docs/machines.md): `baton token create` on the hub's
side, `baton join URL --token T` on the new machine's, `baton machines` to see them and
`baton machines revoke M` to cut one off."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import (
    Json,
    Server,
    Typer,
    app,
    call,
    fail,
    out,
    print_json,
    run,
    with_nats,
)

if TYPE_CHECKING:
    from shared.contracts.control import WorkerInfo
    from shared.contracts.machines import Machine

DEFAULT = "nats://127.0.0.1:4222"
REVOKE_TIMEOUT_S = 15.0

token_app = Typer(help="Join tokens: one-time, expiring rights for a machine to join.",
                  no_args_is_help=True)  # fmt: skip
app.add_typer(token_app, name="token")
machines_app = Typer(
    help="The machines that joined with a token: list them, revoke one.",
    invoke_without_command=True,
)
app.add_typer(machines_app, name="machines")

_SITE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(text: str) -> float:
    """`90`, `90s`, `15m`, `1h`, `7d`: seconds; ValueError for anything else."""
    m = _DURATION.match(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration (90s, 15m, 1h, 7d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


@token_app.command("create")
def create(
    pool: Annotated[str, typer.Option(help="The pool the machine's trainers serve.")] = "default",
    ttl: Annotated[
        str, typer.Option(help="How long the token may be used: 90s, 15m, 1h, 7d.")
    ] = "1h",
    site: Annotated[
        str,
        typer.Option(help="Join at this site's leaf node instead of the hub (it must admit "
                     "machines: `baton up --site S --machines`)."),
    ] = "",
    server: Server = DEFAULT,
    as_json: Json = False,
) -> None:
    """A one-time token for one machine to join POOL: give it to `baton join URL --token T`
    on that machine (URL: the hub's, or with --site that site's). It is refused once used,
    after TTL, or if altered."""
    from baton.client import scheduling
    from shared.machines.registry import Registry

    try:
        ttl_s = seconds(ttl)
    except ValueError as exc:
        fail(f"--ttl: {exc}", code=2)
    run(lambda: call(scheduling.check_pool, pool))
    if site and not _SITE.match(site):
        fail(f"--site: {site!r} is not a site's name (letters, digits, - and _)", code=2)

    async def make(nc: Any) -> tuple[Any, str]:
        await admits_machines(nc)
        return await Registry(nc.jetstream()).create_token(pool, ttl_s, site, by="operator")

    token, text = run(lambda: with_nats(server, make))
    if as_json:
        print_json({"token": text, "id": token.id, "pool": pool, "site": site,
                    "expires_at": token.expires_at})  # fmt: skip
        return
    at = f" at site {site}" if site else ""
    out.print(f"token {token.id} for pool {pool}{at}, valid for {ttl}, once:", soft_wrap=True)
    print(text)
    url = f"<site {site}'s NATS URL>" if site else server.split(",")[0]
    out.print(f"on the new machine: baton join {url} --token {text}", soft_wrap=True)


async def admits_machines(nc: Any) -> None:
    """CliError unless the hub's registrar answers: a token for a hub that admits no
    machines could never be used."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from baton.client.errors import CliError
    from shared.bus import names

    try:
        await nc.request(names.REGISTRAR_HELLO, b"", timeout=5)
    except (NoRespondersError, NatsTimeout):
        raise CliError(
            "this hub admits no machines: start it with `baton up --machines` (its registrar "
            "did not answer)"
        ) from None


@app.command("join")
def join(
    url: Annotated[str | None, typer.Argument(help="The hub's NATS URL.")] = None,
    token: Annotated[str | None, typer.Option(help="A token from `baton token create`.")] = None,
    data_dir: Annotated[
        Path, typer.Option(help="Where this machine keeps its identity, logs and scratch.")
    ] = Path(".baton-machine"),
    trainers: Annotated[
        int | None,
        typer.Option(min=1, max=64, help="Trainers to run. [default: one per GPU, or 2]"),
    ] = None,
    install: Annotated[
        bool,
        typer.Option(help="Install a systemd unit that runs this machine at boot, and exit."),
    ] = False,
    unit_dir: Annotated[Path, typer.Option(help="Where --install writes the unit.")] = Path(
        "/etc/systemd/system"
    ),
) -> None:
    """Join a hub with a token, and run this machine's trainers (one per GPU) until
    Ctrl-C/SIGTERM, each handing its run over first. The machine gets its own identity,
    kept in DATA_DIR: run `baton join --data-dir DATA_DIR` again to start it once more, no
    token needed."""
    import asyncio

    import msgspec

    from baton.stack import machine

    conf = machine.load(data_dir)
    if conf is None:
        if not url or not token:
            fail("a machine that has not joined needs the hub's URL and --token", code=2)
        try:
            conf = asyncio.run(machine.join(url, token, data_dir, trainers))
        except machine.JoinError as exc:
            fail(str(exc), code=2)
        out.print(f"joined as {conf.machine} (pool {conf.pool}); identity in {data_dir}",
                  soft_wrap=True)  # fmt: skip
    else:
        if token:
            out.print(f"{data_dir} holds machine {conf.machine} already; the token is not used",
                      soft_wrap=True)  # fmt: skip
        if trainers is not None and trainers > conf.trainers:
            fail(f"machine {conf.machine} joined with {conf.trainers} trainer(s), and its "
                 "identity speaks for those only: join anew (a new token, another "
                 "--data-dir) to run more", code=2)  # fmt: skip
        if trainers is not None:
            conf = msgspec.structs.replace(conf, trainers=trainers)
    if install:
        unit = unit_dir / "baton-machine.service"
        baton = [sys.executable, "-m", "baton"]
        try:
            unit.parent.mkdir(parents=True, exist_ok=True)
            unit.write_text(machine.systemd_unit(data_dir, baton))
        except OSError as exc:
            fail(f"could not write {unit}: {exc} (run as root, or give --unit-dir)")
        out.print(f"wrote {unit}; start it with: systemctl enable --now baton-machine",
                  soft_wrap=True)  # fmt: skip
        return
    raise typer.Exit(asyncio.run(machine.run_machine(conf, data_dir)))


@machines_app.callback()
def machines(ctx: typer.Context, server: Server = DEFAULT, as_json: Json = False) -> None:
    """Each machine that joined: its host, trainers and GPUs, when it was last heard from,
    the runs it holds."""
    if ctx.invoked_subcommand is not None:
        return
    from baton.client import calls as client
    from shared.machines.registry import Registry

    async def read(nc: Any) -> tuple[list[Machine], list[WorkerInfo]]:
        return await Registry(nc.jetstream()).machines(), await client.workers(nc)

    found, workers = run(lambda: with_nats(server, read))
    rows = [_row(m, workers) for m in sorted(found, key=lambda m: m.joined_at)]
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    table = Table(
        "machine", "host", "pool", "site", "trainers", "gpus", "last seen", "runs", "state"
    )
    for r in rows:
        seen = f"{r['last_seen_s']:.0f}s ago" if r["last_seen_s"] is not None else "-"
        table.add_row(
            r["machine"], r["host"], r["pool"], r["site"] or "-", str(r["trainers"]),
            ", ".join(r["gpus"]) or "-", seen, ", ".join(r["runs"]) or "-", r["state"],
        )  # fmt: skip
    out.print(table)


def _row(m: Machine, workers: list[WorkerInfo]) -> dict[str, Any]:
    import time

    mine = [w for w in workers if w.worker in m.workers()]
    last = max((w.at for w in mine), default=None)
    return {
        "machine": m.id, "host": m.host, "pool": m.pool, "site": m.site, "trainers": m.trainers,
        "gpus": list(m.gpus), "joined_at": m.joined_at,
        "last_seen_s": time.time() - last if last is not None else None,
        "runs": sorted({w.run_id for w in mine if w.run_id}),
        "state": "revoked" if m.revoked else ("up" if mine else "silent"),
    }  # fmt: skip


@machines_app.command("revoke")
def revoke(
    machine: Annotated[str, typer.Argument(help="The machine's id (m-…).")],
    server: Server = DEFAULT,
    as_json: Json = False,
) -> None:
    """Cut MACHINE off: its credentials are refused from now on, its connections are
    closed on every hub node, and the runs it held are handed over at once."""
    from shared.bus import names
    from shared.contracts import decode, encode
    from shared.contracts.machines import Revoke, Revoked

    async def ask(nc: Any) -> Revoked:
        await admits_machines(nc)
        ask = encode(Revoke(machine=machine, by="operator"))
        reply = await nc.request(names.REVOKE_SUBJECT, ask, timeout=REVOKE_TIMEOUT_S)
        return decode(reply.data, Revoked)

    done = run(lambda: with_nats(server, ask))
    if done.error:
        fail(done.error, code=2)
    if as_json:
        print_json(done)
        return
    if done.site:
        out.print(f"{done.machine} revoked; site {done.site} closes its connections and "
                  "refuses it once the record reaches it (at once while linked); its runs "
                  "there are handed over when their leases lapse", soft_wrap=True)  # fmt: skip
        return
    out.print(f"{done.machine} revoked: {done.closed} connection(s) closed; its runs are "
              "handed over", soft_wrap=True)  # fmt: skip
