"""Operator commands that steer the fleet and its runs: drain and undrain a trainer,
checkpoint a run now, pause a run and resume it.

Each writes its order where it is kept and then waits, bounded by `--wait`, for what shows
it was carried out (`baton/cli/drains.py`); `--wait 0` only writes it. At the hub only: a
drain key lives in the hub's bucket, and a run's requests go to the hub's steer subject.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from baton.cli.common import Json, Server, app, out, print_json, run, with_nats

# As in `baton.cli.app`: each command imports NATS and the shared modules itself.

DEFAULT = "nats://127.0.0.1:4222"
Reason = Annotated[str, typer.Option(help="Why (shown in the trainer's log).")]


@app.command()
def drain(
    worker: str,
    reason: Reason = "",
    server: Server = DEFAULT,
    wait: Annotated[
        float,
        typer.Option(
            help="Seconds to wait until it is drained and idle (0: don't). What it runs "
            "hands over at its next checkpoint, within the trainers' grace (BATON_GRACE)."
        ),
    ] = 120.0,
    as_json: Json = False,
) -> None:
    """Take a trainer out of its pool: it takes no new task or rank, what it runs hands
    over at its next checkpoint (another trainer of the pool resumes it, losing no step),
    and it stays so — through its restarts — until `baton undrain`."""
    from baton.cli import drains

    done = run(lambda: with_nats(server, lambda nc: drains.drain(nc, worker, reason, wait)))
    if as_json:
        print_json(done)
    else:
        out.print(f"{worker}: {_said(done, wait)}")
    if wait > 0 and done.live and not done.idle:
        raise typer.Exit(1)


def _said(done: Any, wait: float) -> str:
    """What became of a drain (`drains.Drained`), in a line."""
    rank = "" if done.rank is None else f"its rank {done.rank} of "
    held = "" if done.run_id is None else f"{rank}run {done.run_id}"
    if not done.live and not done.idle:
        return "drained (no live trainer has that name: it takes no work when it starts)"
    if not done.idle and wait <= 0:
        return "drained" + (f"; {held} hands over at its next checkpoint" if held else "")
    if not done.idle:
        return f"drained, but after {wait:.0f}s it " + (
            f"still runs {held}" if held else "has not said so yet"
        )
    gone = "" if done.live else " (its trainer is gone: no heartbeat)"
    if not held:
        return f"drained and idle{gone}"
    if done.ended:
        return f"drained and idle{gone}; run {done.run_id} was {done.ended} meanwhile"
    at = "" if done.step is None else f" at step {done.step}"
    return f"drained and idle{gone}; handed over {held}{at}"


@app.command()
def undrain(worker: str, server: Server = DEFAULT, as_json: Json = False) -> None:
    """Let a drained trainer take work again."""
    from baton.cli import drains

    was = run(lambda: with_nats(server, lambda nc: drains.undrain(nc, worker)))
    if as_json:
        print_json({"worker": worker, "was_drained": was})
    else:
        out.print(f"{worker}: {'undrained' if was else 'was not drained'}; it takes work")


@app.command()
def checkpoint(
    run_id: str,
    reason: Reason = "",
    server: Server = DEFAULT,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for the checkpoint's commit (0: don't).")
    ] = 120.0,
    as_json: Json = False,
) -> None:
    """Write a checkpoint of a run in training now, beside its job's cadence, and print the
    step it was committed at."""
    from baton.cli import drains

    done = run(lambda: with_nats(server, lambda nc: drains.checkpoint(nc, run_id, reason, wait)))
    if as_json:
        print_json(done)
    elif done["step"] is not None:
        out.print(f"{run_id}: checkpoint committed at step {done['step']}")
    elif wait <= 0:
        out.print(f"{run_id}: checkpoint asked of {done['worker']}")
    else:
        out.print(
            f"{run_id}: no checkpoint committed within {wait:.0f}s (the run may have stopped "
            "training meanwhile: `baton status`, `baton dlq list`)"
        )
    if wait > 0 and done["step"] is None:
        raise typer.Exit(1)


@app.command()
def pause(
    run_id: str,
    reason: Annotated[str, typer.Option(help="Recorded in the run and its event.")] = "",
    server: Server = DEFAULT,
    wait: Annotated[float, typer.Option(help="Seconds to wait for PAUSED (0: don't).")] = 60.0,
    as_json: Json = False,
) -> None:
    """Hold a run for a human: a running one checkpoints and stops, a queued one waits.
    Nothing trains it until `baton resume`."""
    from shared.contracts.control import Pause

    _steer_and_wait(Pause(run_id=run_id, reason=reason), "PAUSED", server, wait, as_json)


@app.command()
def resume(
    run_id: str,
    reason: Annotated[str, typer.Option(help="Recorded in the run's event.")] = "",
    server: Server = DEFAULT,
    wait: Annotated[
        float, typer.Option(help="Seconds to wait for it to leave PAUSED (0: don't).")
    ] = 30.0,
    allow_changes: Annotated[
        bool,
        typer.Option(
            "--allow-changes",
            help="Let a deterministic run resume under other software (torch, Python, Baton,"
            " its entry point's code) than its checkpoint recorded: no longer exactly.",
        ),
    ] = False,
    as_json: Json = False,
) -> None:
    """Queue a PAUSED run again: it resumes from its newest committed checkpoint, its
    failures forgiven. A run whose owner's credits cannot hold what it has left to train
    is refused: the dispatcher's reason is printed, exit 1."""
    from shared.contracts.control import Resume

    req = Resume(run_id=run_id, reason=reason, allow_changes=allow_changes)
    _steer_and_wait(req, "QUEUED", server, wait, as_json)


def _steer_and_wait(req: Any, wanted: str, server: str, wait: float, as_json: bool) -> None:
    """Send an operator's request about a run, then wait for the state it leads to. A
    resume the dispatcher refuses (the owner's credits are short of the run's new hold)
    ends at its refusal, exit 1, rather than at the end of the wait."""
    from baton.client import steering

    states = {wanted, "RUNNING"} if wanted == "QUEUED" else {wanted}

    async def go(nc: Any) -> Any:
        return await steering.steer_and_await(nc, req, states, wait)

    record = run(lambda: with_nats(server, go))
    if as_json:
        print_json(record)
    else:
        why = record.pause_requested or record.reason
        out.print(f"{req.run_id}: {record.state.value}" + (f" ({why})" if why else ""))
    if wait > 0 and record.state.value not in states:
        raise typer.Exit(1)
