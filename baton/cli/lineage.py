"""`baton rollback` and `baton fork`: going back to a committed checkpoint of a run, and
starting a new run from one (docs/lineage.md). What they do is `baton.client.rebase`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from baton.cli.common import Json, Server, app, call, out, print_json, run, store_of, with_nats

DEFAULT = "nats://127.0.0.1:4222"
Store = Annotated[str | None, typer.Option("--store", envvar="BATON_STORE", help="Store URL.")]
Step = Annotated[int, typer.Option("--step", min=0, help="The committed checkpoint's step.")]


@app.command()
def rollback(
    run_id: str,
    step: Step,
    reason: Annotated[str, typer.Option(help="Recorded in the run and its event.")] = "",
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the rollback to be done (0: don't).")
    ] = 60.0,
    server: Server = DEFAULT,
    store: Store = None,
    as_json: Json = False,
) -> None:
    """Continue a run from its older committed checkpoint at --step, under a new attempt.
    The checkpoints after it are abandoned: kept until garbage collection, never restored.
    A running attempt stops at once, without a checkpoint; a PAUSED run goes back when
    resumed; a FAILED one is reopened. A COMPLETED or CANCELLED run is forked instead."""
    from baton.client import rebase

    url = store_of(server, store)

    async def go(nc: Any) -> tuple[str, Any]:
        before = await rebase.ask_rollback(nc, url, run_id, step, reason)
        if wait <= 0:
            return "asked", before
        return await rebase.rolled_back(nc, run_id, step, before, wait)

    outcome, record = run(lambda: with_nats(server, go))
    if as_json:
        print_json({"outcome": outcome, "record": record})
    elif outcome == "done":
        done = record.rewinds[-1]
        gone = ", ".join(map(str, done.abandoned)) or "none"
        out.print(
            f"{run_id}: rolled back from step {done.from_step} to {done.to_step} "
            f"(token {done.token}); abandoned: {gone}"
        )
    elif outcome == "ordered" and record.state.value == "PAUSED":
        out.print(f"{run_id}: PAUSED; it goes back to step {step} when resumed")
    elif outcome in ("ordered", "asked"):
        out.print(f"{run_id}: ordered back to step {step}; not done yet ({record.state.value})")
    else:
        why = "its checkpoint went meanwhile" if outcome == "refused" else "see `baton dlq list`"
        out.print(f"{run_id}: the rollback to step {step} was refused ({why})")
    if outcome in ("refused", "not taken"):
        raise typer.Exit(1)


@app.command()
def fork(
    run_id: str,
    step: Step,
    job_file: Annotated[
        Path | None,
        typer.Argument(help="A job file (TOML or JSON) that replaces the parent's spec."),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="PATH=VALUE: change the spec (`config.lr=0.01`, `total_steps=500`); the "
            "value is read as a TOML or JSON scalar. Repeatable.",
        ),
    ] = None,
    key: Annotated[
        str | None, typer.Option(help="The fork's idempotency key [default: a new one].")
    ] = None,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the dispatcher.")] = 10.0,
    server: Server = DEFAULT,
    store: Store = None,
    as_json: Json = False,
) -> None:
    """Start a new run from RUN's committed checkpoint at --step (on its chain, or abandoned
    by a rollback), with its own run id. Its first attempt copies the checkpoint into its own
    prefix, so the parent's retention never touches it; the resume from it is exact."""
    from baton.client import calls as client
    from baton.client import rebase

    url = store_of(server, store)
    job = run(lambda: call(rebase.load_job, job_file))

    async def go(nc: Any) -> tuple[str, Any, Any]:
        parent = await client.record(nc, run_id)
        spec = rebase.fork_spec(parent, step, sets or [], job, key)
        base = await rebase.check_fork(nc, url, parent, step)
        forked, answer = await client.submit(nc, spec, wait)
        return forked, answer, base

    forked, answer, base = run(lambda: with_nats(server, go))
    verdict = type(answer).__name__.lower() if answer is not None else "no answer yet"
    if as_json:
        print_json({
            "run_id": forked, "parent": run_id, "step": step, "answer": verdict,
            "base": {"status": base.status, "token": base.manifest.token,
                     "digest": base.manifest.digest},
        })  # fmt: skip
    else:
        out.print(f"{forked}: forked from {run_id} at step {step} ({verdict})")
    if verdict == "rejected":
        raise typer.Exit(2)
