"""`baton goodput`: where runs' wall time went, per run and summed (`shared.history.goodput`),
and the one way the CLI writes a run's goodput in a line (`describe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Server, app, err, out, print_json, run, with_nats

if TYPE_CHECKING:
    from shared.history.goodput import Goodput

DEFAULT = "nats://127.0.0.1:4222"


def describe(g: Goodput) -> str:
    """`83.1% of 12.4s productive (queued 0.1s, restore 0.2s, …)`: the categories that took
    any time, largest first."""
    rest = sorted(((v, c) for c, v in g.seconds().items() if c != "productive"), reverse=True)
    parts = ", ".join(f"{c} {v:.1f}s" for v, c in rest if abs(v) >= 0.05)
    redone = f"; {g.steps_redone} steps redone" if g.steps_redone else ""
    share = f"{100 * g.goodput:.1f}% of {g.wall_s:.1f}s productive"
    return f"{share} ({parts or 'nothing else'}{redone})"


@app.command("goodput")
def goodput_command(
    server: Server = DEFAULT,
    state: Annotated[
        list[str] | None, typer.Option(help="Only runs in this state (repeatable).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Only runs of this pool.")] = None,
    last: Annotated[int, typer.Option(help="Only the newest N runs that match.")] = 20,
    as_json: Json = False,
) -> None:
    """Goodput per run and summed: the share of wall time spent on training whose progress
    was kept, and where the rest went (queued, start-up, restore, checkpoint stalls, steps
    redone after a failure, recovery). Reads each listed run's events."""
    from rich.table import Table

    from baton.client import calls as client
    from shared.contracts import RunRecord, RunState
    from shared.history.goodput import CATEGORIES, Goodput, goodput

    wanted = {s.upper() for s in state or []}
    if unknown := wanted - {s.value for s in RunState}:
        err.print(f"[red]error:[/red] unknown state {', '.join(sorted(unknown))}")
        raise typer.Exit(2)

    async def go(nc: Any) -> list[tuple[RunRecord, Goodput]]:
        records = [
            r for r in await client.all_records(nc, history=True)
            if (not wanted or r.state.value in wanted) and (pool is None or r.spec.pool == pool)
        ][-last:]  # fmt: skip
        found = []
        for r in records:
            g = goodput(await client.history(nc, r.run_id))
            if g is not None:
                found.append((r, g))
        return found

    rows = run(lambda: with_nats(server, go))
    total = sum((g for _, g in rows), Goodput(wall_s=0.0, finished=True))
    if as_json:
        print_json({"runs": {r.run_id: g.as_dict() for r, g in rows}, "total": total.as_dict()})
        return
    t = Table("run", "state", "goodput", "wall", *CATEGORIES[1:], "redone")
    for r, g in [*rows, (None, total)]:
        secs = g.seconds()
        t.add_row(
            r.run_id if r else "[bold]all[/bold]", r.state.value if r else "",
            f"{100 * g.goodput:.1f}%", f"{g.wall_s:.1f}s",
            *(f"{secs[c]:.1f}s" for c in CATEGORIES[1:]), str(g.steps_redone),
        )  # fmt: skip
    out.print(t)
