"""`baton verify`: the history checker against a running stack — its whole history read
(`shared.history.collect`) and every invariant checked (`shared.history.verify`,
docs/verify.md).

Invariant: the command writes nothing and exits 0 only when no invariant is broken; 1 when
one is, each violation printed (or, with `--json`, one JSON document either way). It reads
every stream and bucket of the history, so it needs an operator's credentials (the default
next to a `baton up`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from baton.cli.common import Json, Server, app, out, print_json, run, store_of, with_nats

if TYPE_CHECKING:
    from shared.history.facts import History

DEFAULT = "nats://127.0.0.1:4222"


@app.command("verify")
def verify_command(
    store: Annotated[str | None, typer.Option(envvar="BATON_STORE", help="Store URL.")] = None,
    server: Server = DEFAULT,
    settled: Annotated[
        bool,
        typer.Option(
            "--settled",
            help="Every ended run with a price must be settled already (the reaper has had "
            "its chance) \\[default: settled at most once].",
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """Check the stack's whole history — events, run records and archive, leases, ledger,
    checkpoint store — against Baton's invariants: "no violation", or each one broken."""
    from shared.checkpoint.store import open_store
    from shared.history.collect import collect
    from shared.history.verify import check, describe

    url = store_of(server, store)

    async def read(nc: Any) -> History:
        async with open_store(url) as opened:
            return await collect(nc, opened)

    history = run(lambda: with_nats(server, read))
    found = check(history, settled_exactly=settled)
    if as_json:
        print_json(
            {
                "ok": not found,
                "runs": len(history.run_ids()),
                "events": len(history.events),
                "entries": len(history.ledger),
                "unreadable": history.unreadable,
                "violations": found,
            }
        )
    elif not found:
        out.print(
            f"no violation ({len(history.run_ids())} runs, {len(history.events)} events, "
            f"{len(history.ledger)} ledger entries)",
            soft_wrap=True,
        )
    else:
        for violation in found:
            out.print(describe(violation), soft_wrap=True, markup=False, highlight=False)
        out.print(f"{len(found)} violation{'s' * (len(found) != 1)}", soft_wrap=True)
    if found:
        raise typer.Exit(1)
