"""`baton watch`: a run's events as a live progress bar and a log of what happened."""

from __future__ import annotations

import json
import sys

import msgspec
from nats.aio.client import Client
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from baton.client import calls as client
from baton.client import watching
from baton.client.watching import ending, until_end
from shared.contracts import RunRecord, RunState
from shared.contracts.events import (
    AttemptFailed,
    Cancelled,
    CheckpointCommitted,
    Completed,
    Diverged,
    Event,
    Failed,
    Fenced,
    Forked,
    GroupFormed,
    Guarded,
    HandedOver,
    Paused,
    Preempted,
    RankLost,
    Rejected,
    Resized,
    Resumed,
    RolledBack,
    RunWarning,
    StallRecovered,
    Started,
    loss_of,
)
from shared.contracts.events import (
    Progress as ProgressEvent,
)
from shared.contracts.events import Restored as RestoredEvent


def describe(event: Event) -> str | None:
    """One line for the events worth a line; None for progress and routine commits."""
    line = _attempt_line(event)
    return line if line is not None else _run_line(event)


def _attempt_line(event: Event) -> str | None:
    """What happened to one attempt: it started, resumed past damage or at another size
    (a sharded checkpoint), was fenced, resumed inexactly, was preempted or failed."""
    match event:
        case Started():
            return (
                f"started on {event.worker} at step {event.start_step}"
                f" (attempt {event.attempt}, token {event.token})"
            )
        case RestoredEvent() if event.damaged:
            return (
                f"[yellow]skipped damaged checkpoints[/yellow] {event.damaged};"
                f" resumed from step {event.step}"
            )
        case RestoredEvent() if event.resharded_from:
            return (
                f"resumed step {event.step} from the shards of {event.resharded_from} ranks"
                f" (rank 0 read {event.read_bytes / 2**20:.1f} MiB of them): loaded exactly,"
                " not the old size's bits from here"
            )
        case Fenced():
            return f"[red]fenced[/red] {event.worker}: {event.reason}"
        case Diverged():
            return f"[red]diverged[/red]: {divergence(event)}"
        case Preempted():
            why = f" ({event.reason})" if event.reason else ""
            return f"[yellow]preempted[/yellow] on {event.worker} after step {event.step}{why}"
        case AttemptFailed():
            return f"[red]attempt {event.attempt} failed[/red]: {event.reason}"
        case HandedOver():
            return f"[yellow]handed over[/yellow] from {event.worker}: {event.reason}"
    return _group_line(event) or _care_line(event)


def _group_line(event: Event) -> str | None:
    """What happened to a group of ranks: it formed, or lost a rank."""
    match event:
        case GroupFormed():
            ranks = ", ".join(f"{r}: {w}" for r, w in enumerate(event.members))
            return f"group of {len(event.members)} formed, epoch {event.epoch} ({ranks})"
        case RankLost():
            return (
                f"[yellow]rank {event.rank} lost[/yellow] ({event.lost}, epoch {event.epoch})"
                f" at step {event.step}: {event.reason}; the group forms again"
            )
        case Resized():
            return (
                f"[cyan]resized[/cyan] from {event.from_ranks} to {event.to_ranks} ranks at "
                f"step {event.step}, epoch {event.epoch}: {event.reason}"
            )
    return None


def _care_line(event: Event) -> str | None:
    """What needs an operator's eye, and what operators did: a warning (a stall, a
    timeout, a budget), the divergence guard, a pause and a resume, a rollback, a fork."""
    match event:
        case RunWarning():
            return f"[yellow]warning ({event.kind})[/yellow]: {event.detail}"
        case StallRecovered():
            return f"stepped again at step {event.step} after {event.quiet_s:.0f}s without a step"
        case Guarded():
            back = f" from step {event.good_step}" if event.action == "rollback" else ""
            return (
                f"[red]divergence guard[/red] at step {event.step}: {event.metric} = "
                f"{event.value} ({event.rule}); {event.action}{back}"
            )
        case Paused():
            return f"[yellow]paused[/yellow] at step {event.step}: {event.reason}"
        case Resumed():
            return f"resumed: {event.reason}"
        case RolledBack():
            return f"[cyan]rolled back[/cyan] from step {event.from_step} to {event.to_step}"
        case Forked():
            return f"[cyan]forked[/cyan] from {event.parent} at step {event.step}"
    return None


def _run_line(event: Event) -> str | None:
    """How the run ended, and its final checkpoint."""
    match event:
        case Completed():
            digest = event.digest[:16]
            return f"[green]completed[/green] at step {event.step}; weights digest {digest}…"
        case Failed():
            return f"[red]failed[/red]: {event.reason}\n{event.detail}"
        case Cancelled():
            return f"[yellow]cancelled[/yellow]: {event.reason}"
        case Rejected():
            return f"[red]rejected[/red]: {event.reason} (at {event.path})"
        case CheckpointCommitted() if event.final:
            return f"final checkpoint committed at step {event.step}"
    return None


def divergence(event: Diverged) -> str:
    return (
        f"{event.metric} at step {event.step} was {event.expected} before, {event.got} after"
        f" resuming from step {event.checkpoint} on {event.worker}: this run's resume is not"
        " exact (see docs/training.md, 'Making a training loop resumable')"
    )


QUIET_S = watching.QUIET_S
"""Seconds without an event after which `watch` looks at the run record (a test shortens
it)."""


async def watch_run(nc: Client, run_id: str, console: Console, as_json: bool) -> bool:
    """Follow a run to its end: True if it completed. The end is its terminal event, or a
    terminal run record seen during a quiet spell when that event never comes."""
    record = await client.record(nc, run_id)
    if as_json:
        return await _watch_as_json(nc, run_id)
    return await _watch_with_bar(nc, run_id, record, console)


async def _watch_as_json(nc: Client, run_id: str) -> bool:
    """One JSON line per event, and the record as the last line if it ended the watch."""
    async for item in until_end(nc, run_id, QUIET_S):
        if isinstance(item, RunRecord):
            last = {"type": "record", "record": msgspec.to_builtins(item)}
            sys.stdout.write(json.dumps(last) + "\n")
            return item.state is RunState.COMPLETED
        sys.stdout.write(json.dumps(json.loads(msgspec.json.encode(item))) + "\n")
        sys.stdout.flush()
        if (done := ending(item)) is not None:
            return done
    return False


async def _watch_with_bar(nc: Client, run_id: str, record: RunRecord, console: Console) -> bool:
    """A progress bar of steps, loss and speed, with a line for each event worth one."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} steps/s"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(record.spec.name, total=record.spec.total_steps, loss="-", rate="-")
        async for item in until_end(nc, run_id, QUIET_S):
            if isinstance(item, RunRecord):
                why = f": {item.reason}" if item.reason else ""
                bar.console.print(
                    f"{item.state.value.lower()} at step {item.step} (from the run record;"
                    f" its event is missing){why}"
                )
                return item.state is RunState.COMPLETED
            if isinstance(item, ProgressEvent | Completed):
                loss = loss_of(item.metrics)
                shown = f"{loss:.4f}" if loss is not None else "-"
                bar.update(task, completed=item.step, loss=shown)
            if isinstance(item, ProgressEvent):
                bar.update(task, rate=f"{item.steps_per_s:.0f}")
            if (line := describe(item)) is not None:
                bar.console.print(line)
            if (done := ending(item)) is not None:
                return done
    return False
