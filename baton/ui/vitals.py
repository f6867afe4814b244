"""What an operator watches on a run's page beside its timeline. Invariant: every time here
is on the hub's clock — `events` are the run's events after
`shared.history.clocks.on_hub_clock`, in stream order, as `views.run_view` passes them — and
every duration is a difference of two such times or one a single process measured
(`checkpoint_age_s`, `quiet_s`: its trainer's monotonic clock); what is in force (a pause
asked, a rollback ordered, the data left out, the lineage) is the record's to say, when and
how it happened the events'.

    hold            PAUSED and why; asked to pause or cancel; ordered back to a step
    lineage         forked from which run at which step; each rollback
    guard           the divergence guard's stops; the data its rollbacks left out
    stalls          each stall warned of, and whether the run stepped again
    at_risk         what a failure now would lose (the running attempt's last report)
    interruptions   each time the run went without progress, by cause, with its cost
    rounds          a replica's outer rounds: who took part in each, who committed it,
                    stragglers, bytes, its waits; its boundaries without the store
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.contracts import RunRecord, RunState
from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.history.recovery import by_cause, recoveries

STALLED = "stalled"
"""The `warning` kind of a stall (`services/trainer/stall.py`)."""


def vitals(record: RunRecord, events: list[Event]) -> dict[str, Any]:
    """All of the below, as the run's page is sent it."""
    return {
        "hold": hold(record, events),
        "lineage": lineage(record, events),
        "guard": guard(record, events),
        "stalls": stalls(events),
        "at_risk": at_risk(record, events),
        "interruptions": interruptions(events),
        "rounds": rounds(record, events),
    }


def hold(record: RunRecord, events: list[Event]) -> dict[str, Any]:
    """What holds or stops the run: PAUSED and why (`pause_requested`, else its last
    `paused` event's reason), asked to pause or cancel while it trains, ordered back to a
    step (`rollback_to`)."""
    paused = record.state is RunState.PAUSED
    why = record.pause_requested
    if paused and why is None:
        why = next((e.reason for e in reversed(events) if isinstance(e, ev.Paused)), None)
    live = not record.state.terminal
    return {
        "paused": paused,
        "pausing": record.state is RunState.RUNNING and record.pause_requested is not None,
        "why": why,
        "cancelling": record.cancel_requested if live else None,
        "rollback_to": record.rollback_to if live else None,
        "rollback_reason": record.rollback_reason if live else None,
    }


def lineage(record: RunRecord, events: list[Event]) -> dict[str, Any]:
    """Where the run came from and went back to: the run and step it was forked from (its
    spec's `fork`) and its graft (the `forked` event); each rollback the record keeps, with
    the time of its `rolled_back` event when that is stored."""
    fork = record.spec.fork
    graft = next((e for e in reversed(events) if isinstance(e, ev.Forked)), None)
    done = {(e.token, e.to_step): e.at for e in events if isinstance(e, ev.RolledBack)}
    return {
        "forked_from": {"run_id": fork.run_id, "step": fork.step} if fork else None,
        "graft": {"token": graft.token, "digest": graft.digest, "at": graft.at} if graft else None,
        "rewinds": [
            {**msgspec.to_builtins(r), "at": done.get((r.token, r.to_step))} for r in record.rewinds
        ],
    }


def guard(record: RunRecord, events: list[Event]) -> dict[str, Any]:
    """The divergence guard's stops (`guarded` events: the step, the metric and its value,
    the rule, the action taken, the last good checkpoint) and the data its rollbacks left
    out (`RunRecord.skips`: after which checkpoint, how many batches)."""
    return {
        "actions": [_fields(e) for e in events if isinstance(e, ev.Guarded)],
        "skips": [msgspec.to_builtins(s) for s in record.skips],
    }


def stalls(events: list[Event]) -> list[dict[str, Any]]:
    """Each stall the run's trainer warned of (`warning`, kind `stalled`), and whether it
    stepped again (`stall_recovered`: at which step, after how long without one) — a stall
    not recovered was stopped, or is going on."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ev.RunWarning) and e.kind == STALLED:
            stall = {"at": e.at, "detail": e.detail, "recovered_at": None, "step": None}
            out.append({**stall, "quiet_s": None})
        elif isinstance(e, ev.StallRecovered) and out and out[-1]["recovered_at"] is None:
            out[-1].update(recovered_at=e.at, step=e.step, quiet_s=e.quiet_s)
    return out


def at_risk(record: RunRecord, events: list[Event]) -> dict[str, Any] | None:
    """What a failure now would lose, by the running attempt's latest `progress`: the steps
    done since the newest committed checkpoint and that checkpoint's age, as its trainer
    measured them when it reported (`at`). None unless the run is RUNNING and its attempt
    has reported since it started: between attempts nothing is in training to lose."""
    if record.state is not RunState.RUNNING:
        return None
    for e in reversed(events):
        if isinstance(e, ev.Started):
            return None
        if isinstance(e, ev.Progress):
            risk = {"step": e.step, "steps": e.steps_at_risk, "at": e.at, "worker": e.worker}
            return {**risk, "checkpoint_age_s": e.checkpoint_age_s}
    return None


def interruptions(events: list[Event]) -> dict[str, Any]:
    """Each interruption and how long the run went without progress for it
    (`shared.history.recovery`), and by cause: how many, and their mean."""
    found = recoveries(events)
    return {
        "each": [msgspec.to_builtins(r) for r in found],
        "by_cause": [
            {"cause": cause, "count": count, "mean_s": mean}
            for cause, (count, mean) in by_cause(found).items()
        ],
    }


def rounds(record: RunRecord, events: list[Event]) -> dict[str, Any] | None:
    """A replica of a replicated run (docs/diloco.md): each round its change joined, and
    each boundary where it was discarded or skipped (the store out of reach)."""
    if record.spec.replica is None:
        return None
    notes = [(e.at, e.note) for e in events if isinstance(e, ev.Round)]
    return {
        "replica": record.spec.replica,
        "replicas": record.spec.max_replicas,
        "inner_steps": record.spec.outer.inner_steps,
        "each": [
            {"at": at, **msgspec.to_builtins(n), "bytes": n.sent_bytes + n.received_bytes}
            for at, n in notes
        ],
        "waited_s": sum(n.waited_s for _, n in notes),
    }


def _fields(e: Event) -> dict[str, Any]:
    """An event's own fields and its time (on the hub's clock), without its type and run."""
    out: dict[str, Any] = msgspec.to_builtins(e)
    for key in ("type", "run_id"):
        out.pop(key, None)
    return out
