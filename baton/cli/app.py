"""`baton`: run the stack, submit jobs, watch them, pull their weights.

Exit codes: 0 success; 1 the run failed, or NATS/the store could not be reached; 2 bad
input (an invalid job spec, a bad option); 3 not found (no such run, no checkpoint yet).
Every client command takes `--server/-s` (or `NATS_URL`) and `--json` for scripts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli import up as _up  # noqa: F401  (registers `baton up`, first in the list)
from baton.cli.common import (
    SERVICES,
    Connection,
    Json,
    OwnTelemetry,
    Server,
    Site,
    app,
    call,
    err,
    fmt,
    out,
    print_json,
    run,
    stop_telemetry,
    traced,
    with_nats,
)

if TYPE_CHECKING:
    pass

# Every command imports what it needs (NATS, msgspec, rich's tables, the shared modules)
# in its body: `baton --help` and a mistyped option answer at once (tests/cli/test_imports.py).

@app.command(cls=OwnTelemetry)
def service(
    name: Annotated[
        str, typer.Argument(help="dispatcher, trainer, checkpointer, reaper or notifier")
    ],
) -> None:
    """Run one service in the foreground (as the compose file does)."""
    import runpy

    known = (*SERVICES, "notifier")
    if name not in known:
        err.print(f"[red]error:[/red] unknown service {name!r}; choose one of {', '.join(known)}")
        raise typer.Exit(2)
    runpy.run_module(f"services.{name}", run_name="__main__", alter_sys=True)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="Job spec, .toml or .json.")],
    server: Server = "nats://127.0.0.1:4222",
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the dispatcher's answer.")
    ] = 10.0,
    site: Site = "",
    as_json: Json = False,
) -> None:
    """Submit a job; prints its run id once the dispatcher accepted it."""
    from baton.client import calls as client
    from shared.contracts.events import Rejected

    spec = run(lambda: call(client.load_spec, file))

    async def go() -> tuple[str, Any]:
        nc = await client.open_nats(server, **Connection.options())
        try:
            return await client.submit(nc, spec, wait, site)
        finally:
            await nc.close()

    run_id, answer = run(go)
    if isinstance(answer, Rejected):
        err.print(f"[red]rejected:[/red] {answer.reason} (at {answer.path})")
        raise typer.Exit(2)
    unconfirmed = getattr(answer, "unconfirmed", False)
    if as_json:
        print_json({"run_id": run_id, "accepted": answer is not None, "unconfirmed": unconfirmed})
    else:
        out.print(run_id)
        if unconfirmed:
            err.print(f"[yellow]accepted at site {site} while it is cut off from the hub: if the"
                      " hub runs the same job too, the checkpoint store decides at heal which"
                      " run counts[/yellow]")  # fmt: skip
        if answer is None and wait > 0:
            where = f"site {site}'s outbox until the hub takes it" if site else "the queue"
            err.print(f"[yellow]no answer from a dispatcher yet; the job waits in {where}[/yellow]")


@app.command()
def runs(
    server: Server = "nats://127.0.0.1:4222",
    state: Annotated[
        list[str] | None, typer.Option(help="Only runs in this state (repeatable).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Only runs of this pool.")] = None,
    every: Annotated[
        bool,
        typer.Option(
            "--all", help="Every run ever, the archived ones too (implied by --state of an end)."
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """List the live runs, and those that ended within BATON_GC_AGE (an hour by default),
    oldest first; `--all` lists every run."""
    from rich.table import Table

    from baton.client import calls as client
    from shared.contracts import RunState
    from shared.contracts.events import loss_of

    wanted = {s.upper() for s in state or []}
    unknown = wanted - {s.value for s in RunState}
    if unknown:
        err.print(f"[red]error:[/red] unknown state {', '.join(sorted(unknown))}")
        raise typer.Exit(2)
    history = every or any(RunState(s).terminal for s in wanted)
    records = [
        r
        for r in run(lambda: with_nats(server, lambda nc: client.all_records(nc, history)))
        if (not wanted or r.state.value in wanted) and (pool is None or r.spec.pool == pool)
    ]
    if as_json:
        print_json(records)
        return
    t = Table("run", "name", "pool", "state", "step", "attempts", "worker", "site", "loss")
    for r in records:
        t.add_row(
            r.run_id, r.spec.name, r.spec.pool, r.state.value, f"{r.step}/{r.spec.total_steps}",
            str(r.attempts), r.worker or "-", r.site or "-", fmt(loss_of(r.metrics)),
        )  # fmt: skip
    out.print(t)


@app.command()
def watch(run_id: str, server: Server = "nats://127.0.0.1:4222", as_json: Json = False) -> None:
    """Follow a run live; exits 0 when it completes, 1 when it fails or is cancelled."""
    from baton.cli.watch import watch_run

    ok = run(lambda: with_nats(server, lambda nc: watch_run(nc, run_id, out, as_json)))
    raise typer.Exit(0 if ok else 1)


@app.command()
def cancel(
    run_id: str,
    reason: Annotated[
        str, typer.Option(help="Recorded in the run and its event.")
    ] = "cancelled by user",
    server: Server = "nats://127.0.0.1:4222",
    wait: Annotated[float, typer.Option(help="Seconds to wait for CANCELLED (0: don't).")] = 60.0,
    site: Site = "",
    as_json: Json = False,
) -> None:
    """Cancel a queued or running run. A running one checkpoints before it stops."""
    import asyncio

    from baton.client import calls as client
    from shared.bus import names

    domain = names.HUB_DOMAIN if site else None

    async def go(nc: Any) -> Any:
        await client.cancel(nc, run_id, reason, site)
        deadline = asyncio.get_running_loop().time() + wait
        while wait > 0 and asyncio.get_running_loop().time() < deadline:
            record = await client.record(nc, run_id, domain)
            if record.state.terminal:
                return record
            await asyncio.sleep(0.2)
        return await client.record(nc, run_id, domain)

    record = run(lambda: with_nats(server, go))
    if as_json:
        print_json(record)
    else:
        out.print(
            f"{run_id}: {record.state.value}" + (f" ({record.reason})" if record.reason else "")
        )
    if wait > 0 and record.state.value != "CANCELLED":
        raise typer.Exit(1)


@app.command()
def workers(server: Server = "nats://127.0.0.1:4222", as_json: Json = False) -> None:
    """List live trainers from the worker registry: pool, device, current run and step,
    whether it is drained (`baton drain`), and when the hub last heard each (its server's
    clock: a trainer's own clock may be off)."""
    from rich.table import Table

    from baton.client import calls as client

    if as_json:
        print_json(run(lambda: with_nats(server, client.workers)))
        return
    found = run(lambda: with_nats(server, client.workers_seen))
    t = Table("worker", "pool", "host", "device", "gpu", "run", "rank", "step", "drained", "seen")
    for w, seen_s in found:
        gpu = f"{w.gpu_name} ({w.gpu_memory_bytes / 2**30:.0f} GiB)" if w.gpu_name else "-"
        t.add_row(
            w.worker, w.pool, w.host, w.device, gpu, w.run_id or "-",
            "-" if w.rank is None else str(w.rank), "-" if w.step is None else str(w.step),
            "drained" if w.drained else "-", f"{seen_s:.0f}s ago",
        )  # fmt: skip
    out.print(t)


@app.command()
def schema() -> None:
    """Print the JSON Schema of a job spec, for submitting from any NATS client."""
    import json

    from shared.contracts import job_schema

    sys.stdout.write(json.dumps(job_schema(), indent=2) + "\n")


@app.command()
def demo(
    keep: Annotated[bool, typer.Option(help="Leave the demo's data directory behind.")] = False,
) -> None:
    """The quickstart: start the stack, train the example, SIGKILL its trainer mid-run, let
    another finish it, and compare the weights with an uninterrupted run."""
    from baton.cli.demo import run_demo

    raise typer.Exit(run(lambda: run_demo(out, keep)))


@app.command()
def report(
    run_id: str,
    out_dir: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for <run>.png and <run>.html.")
    ] = Path("reports"),
    server: Server = "nats://127.0.0.1:4222",
    as_json: Json = False,
) -> None:
    """Draw a run's history (loss per attempt, interruptions, resumes, commits) as a PNG and
    a self-contained HTML page, and print their paths."""
    from baton.cli import rounds
    from baton.cli.report import on_hub_clock, render
    from baton.client import calls as client
    from baton.client.errors import CliError

    async def go(nc: Any) -> list[tuple[Any, Any]]:
        try:
            return [(await client.record(nc, run_id), await on_hub_clock(nc, run_id))]
        except CliError:  # a replicated run: a report of each replica
            if (found := await rounds.replicated(nc, run_id)) is None:
                raise
            return [(r, await on_hub_clock(nc, r.run_id)) for r in found.records]

    drawn = []
    for record, events in run(lambda: with_nats(server, go)):
        try:  # drawing needs no connection: it runs after NATS is closed
            drawn.append((record.run_id, *render(record, events, out_dir)))
        except OSError as exc:
            err.print(f"[red]error:[/red] cannot write the report into {out_dir}: {exc.strerror}")
            raise typer.Exit(1) from None
    if as_json:
        reports = [{"run_id": r, "png": str(png), "html": str(page)} for r, png, page in drawn]
        print_json(reports[0] if len(reports) == 1 else {"run_id": run_id, "replicas": reports})
    else:
        out.print("\n".join(f"{png}\n{page}" for _, png, page in drawn))


Opt = str | None


@app.callback()
def connection(
    creds: Annotated[
        str | None, typer.Option(envvar="NATS_CREDS", help="NATS credentials file (JWT).")
    ] = None,
    auth_file: Annotated[
        str | None,
        typer.Option(
            envvar="NATS_AUTH_FILE",
            help="NATS user and password file, as `baton up` writes them "
            "\\[default: ./.baton/auth/operator.env if present].",
        ),
    ] = None,
    tlsca: Annotated[
        str | None, typer.Option(envvar="NATS_CA", help="CA to verify the server.")
    ] = None,
    tlscert: Annotated[
        str | None, typer.Option(envvar="NATS_CERT", help="Client certificate.")
    ] = None,
    tlskey: Annotated[
        str | None, typer.Option(envvar="NATS_KEY", help="Client certificate key.")
    ] = None,
) -> None:
    """Resumable PyTorch training on spare, unreliable GPUs."""
    Connection.creds, Connection.auth_file, Connection.tls_ca = creds, auth_file, tlsca
    Connection.tls_cert, Connection.tls_key = tlscert, tlskey


from baton.cli import credits as _credits  # noqa: E402, F401  (balances, holds, top-ups)
from baton.cli import goodput as _goodput  # noqa: E402, F401  (registers its command)
from baton.cli import lineage as _lineage  # noqa: E402, F401  (rollback and fork)
from baton.cli import machines as _machines  # noqa: E402, F401  (tokens, join, machines)
from baton.cli import operate as _operate  # noqa: E402, F401  (drain, undrain, checkpoint)
from baton.cli import ops  # noqa: E402, F401  (registers the operator commands)
from baton.cli import people as _people  # noqa: E402, F401  (add, remove, list)
from baton.cli import pools as _pools  # noqa: E402, F401  (the pools' table in force)
from baton.cli import pull as _pull  # noqa: E402, F401  (registers its command)
from baton.cli import queue as _queue  # noqa: E402, F401  (a pool's queue, in order)
from baton.cli import rounds as _rounds  # noqa: E402, F401  (a replicated run's rounds)
from baton.cli import status as _status  # noqa: E402, F401  (one run's record and health)
from baton.cli import verify as _verify  # noqa: E402, F401  (the history checker)


def main() -> None:
    # Each command sets up telemetry as it starts (`common._Command`); this flushes it.
    traced()
    try:
        app()
    finally:
        stop_telemetry()
