"""`baton status`: one run's record and what an operator reads of it — its group, why it is
held, what its divergence guard did, where it came from (fork, rollbacks), what a failure
now would lose, its interruptions by cause, its stalls.

As everywhere in the CLI, the command imports NATS and the shared modules in its body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton.cli.common import Json, Server, app, fmt, out, print_json, run, with_nats

if TYPE_CHECKING:
    from shared.contracts import RunRecord
    from shared.contracts.events import Event


@app.command()
def status(run_id: str, server: Server = "nats://127.0.0.1:4222", as_json: Json = False) -> None:
    """Show one run's record: state, committed step, attempts, worker, digest, and whether
    a resume was found not exact."""
    import msgspec
    from rich.table import Table

    from baton.cli import rounds
    from baton.cli.goodput import describe
    from baton.cli.watch import divergence
    from baton.client import calls as client
    from baton.client.errors import CliError
    from shared.contracts.events import Diverged, loss_of
    from shared.history.goodput import goodput as spent_of

    async def get(nc: Any) -> tuple[RunRecord | rounds.Replicated, list[Event] | None]:
        try:
            return await client.record(nc, run_id), await client.readable_history(nc, run_id)
        except CliError:  # no such run: perhaps a replicated one, whose replicas are runs
            if (replicated := await rounds.replicated(nc, run_id)) is None:
                raise
            return replicated, None

    # At a site its operator reads the record from the hub, not the run's events (None).
    record, found = run(lambda: with_nats(server, get))
    if isinstance(record, rounds.Replicated):
        return rounds.show(record, as_json)
    events = found or []
    diverged = [e for e in events if isinstance(e, Diverged)]
    spent = spent_of(events)
    if as_json:
        print_json({
            **msgspec.to_builtins(record), "diverged": msgspec.to_builtins(diverged),
            "goodput": spent.as_dict() if spent else None, "events": found is not None,
        })  # fmt: skip
        return
    exact = "-"
    if diverged:
        exact = "[red]diverged[/red]: " + "; ".join(divergence(d) for d in diverged)
    elif record.spec.deterministic:
        exact = "no divergence seen"
    t = Table(show_header=False, box=None)
    for k, v in [
        ("run", record.run_id),
        ("name", record.spec.name),
        ("state", record.state.value),
        ("step", f"{record.step}/{record.spec.total_steps} (committed)"),
        ("attempts", str(record.attempts)),
        ("retries", str(record.retries)),
        ("worker", record.worker or "-"),
        ("token", str(record.token or "-")),
        ("site", f"{record.site} (granted, epoch {record.epoch})" if record.site else "-"),
        *_sharing_rows(record, events),
        *_group_rows(record, events),
        *(
            [("replica", f"{record.spec.replica} of {record.spec.max_replicas} (`baton rounds`)")]
            if record.spec.replica is not None
            else []
        ),
        *_lineage_rows(record),
        *_health_rows(record, events),
        ("loss", fmt(loss_of(record.metrics))),
        ("digest", record.digest or "-"),
        ("exact", exact),
        *([("resumed under", _changed(record))] if record.changed else []),
        ("goodput", describe(spent) if spent else "-"),
        ("reason", record.reason or "-"),
        *([("events", "not readable from this site (exact, goodput unknown)")] * (found is None)),
    ]:
        t.add_row(f"[bold]{k}[/bold]", v)
    out.print(t)


def _changed(record: RunRecord) -> str:
    """What its last resume ran under that its checkpoint did not (`baton.runtime.compat`)."""
    allowed = " (allowed by its operator)" if record.changes_allowed else ""
    return f"other software than its checkpoint: {'; '.join(record.changed)}{allowed}"


def _sharing_rows(record: RunRecord, events: list[Event]) -> list[tuple[str, str]]:
    """Its owner and priority, the runs it made room for, and its credits
    (docs/scheduling.md); why it waits is the scheduler's to say (`waiting`)."""
    from shared.contracts.events import Preempted
    from shared.contracts.pools import credits

    rows = [("owner", record.owner or "operator"), ("priority", str(record.priority))]
    made_room = [e for e in events if isinstance(e, Preempted) and e.by]
    if made_room:
        last = made_room[-1]
        rows.append(("preempted", f"{len(made_room)}x; last for {last.by} at step {last.step} "
                     f"({last.reason})"))  # fmt: skip
    if record.preempt is not None:
        rows.append(("making room", f"for {record.preempt.by}: {record.preempt.reason}"))
    if record.price:
        price = ", ".join(f"{k} {v:g}" for k, v in sorted(record.price.items()))
        held = f"{credits(record.held)} held ({len(record.holds)} hold(s))"
        state = "settled" if record.settled else "to settle when it ends"
        rows.append(("credits", f"{held} at {price} credits/trainer-s; {state} "
                     "(`baton credits`)"))  # fmt: skip
    return rows


def _health_rows(record: RunRecord, events: list[Event]) -> list[tuple[str, str]]:
    """Why a run waits for a human, what its divergence guard did, what a failure now would
    lose, how long its interruptions cost by cause, its stalls."""
    from shared.contracts.events import Guarded, Progress, RunWarning, StallRecovered
    from shared.history.recovery import by_cause, recoveries

    rows = []
    if record.pause_requested:
        held = "held" if record.state.value == "PAUSED" else "asked to pause"
        rows.append(("paused", f"{held}: {record.pause_requested} (`baton resume` to go on)"))
    for g in (e for e in events if isinstance(e, Guarded)):
        what = f"step {g.step}: {g.metric} = {g.value} ({g.rule}); {g.action}"
        if g.action == "rollback":
            what += f" from step {g.good_step}"
        rows.append(("guard", what))
    if record.skips:
        left = ", ".join(f"{s.batches} batch(es) after step {s.after}" for s in record.skips)
        rows.append(("left out", left))
    progress = [e for e in events if isinstance(e, Progress)]
    if progress and not record.state.terminal:
        p = progress[-1]
        rows.append(("at risk", f"{p.steps_at_risk} step(s), {p.checkpoint_age_s:.0f}s of "
                     "training since the newest committed checkpoint"))  # fmt: skip
    found = by_cause(recoveries(events))
    if found:
        rows.append(("recoveries", "; ".join(
            f"{cause} {n} (mean {mean:.1f}s)" for cause, (n, mean) in found.items()
        )))  # fmt: skip
    stalls = [e for e in events if isinstance(e, RunWarning) and e.kind == "stalled"]
    if stalls:
        recovered = sum(isinstance(e, StallRecovered) for e in events)
        rows.append(("stalls", f"{len(stalls)} ({recovered} recovered); last: {stalls[-1].detail}"))
    return rows


def _lineage_rows(record: RunRecord) -> list[tuple[str, str]]:
    """Where the run came from and went back to: forked from another run's checkpoint, its
    rollbacks (the last three), a rollback ordered and not done yet."""
    rows = []
    if (fork := record.spec.fork) is not None:
        rows.append(("lineage", f"forked from {fork.run_id} at step {fork.step}"))
    for r in record.rewinds[-3:]:
        gone = f"; abandoned {', '.join(map(str, r.abandoned))}" if r.abandoned else ""
        why = f" ({r.reason})" if r.reason else ""
        moved = f"step {r.from_step} → {r.to_step}, token {r.token}"
        rows.append(("rolled back", f"{moved}{gone}{why}"))
    if record.rollback_to is not None and not record.state.terminal:
        rows.append(("rollback", f"to step {record.rollback_to}, ordered"))
    return rows


def _group_rows(record: RunRecord, events: list[Event] | None = None) -> list[tuple[str, str]]:
    """A run of several ranks: its group (workers by rank, its epoch), or why it waits; an
    elastic run's size now and its resizes."""
    from shared.contracts.events import Resized

    spec = record.spec
    if spec.ranks == 1:
        return []
    size = str(spec.ranks)
    if spec.elastic:
        now = f"; {record.group_size} now" if record.group and record.group_size else ""
        size = f"{spec.min_ranks} to {spec.max_ranks} (elastic{now})"
    rows = [("ranks", size)]
    resized = [e for e in events or [] if isinstance(e, Resized)]
    if resized:
        last = resized[-1]
        rows.append((
            "resized", f"{len(resized)} time(s); last {last.from_ranks} → {last.to_ranks} "
            f"at step {last.step}: {last.reason}",
        ))  # fmt: skip
    if record.group:
        held = ", ".join(f"{rank}: {worker}" for rank, worker in enumerate(record.group))
        rows.append(("group", f"epoch {record.token}; {held}"))
    if record.waiting and not record.state.terminal and not record.group:
        rows.append(("waiting", record.waiting))
    return rows
