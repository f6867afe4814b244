"""A trainer's verdict on a task, and the one function that carries it out.

Whatever ends a task at a trainer — an attempt, a refused entry point, a cancel found before
any work, a failure around the attempt — decides a `Verdict`, and `apply` carries it out in
one order: the record change (retried through outages; a terminal one announces itself,
`shared.state.endings`), the attempt's own event, the lease released, the message answered.

    outcome    record change                       event             lease     message
    COMPLETED  COMPLETED: step, digest, metrics    completed.<run>   released  ack
    CANCELLED  CANCELLED                           cancelled.<run>   released  ack
    STOPPED    none (the run ended elsewhere)      none              released  ack
    PREEMPTED  worker cleared, time booked         preempted         released  nak(0)
    ROLLED_BACK  as PREEMPTED, data to leave out   (guarded)         released  nak(0)
    RETRY      retries + 1                         attempt_failed    released  nak(back-off)
    FAILED     FAILED (retries used up, or fail    failed.<run>      released  ack
               fast)
    PAUSED     PAUSED (asked, or the policy)       paused            released  ack
    FENCED     none                                fenced            kept      none

The record decides the outcome the change leads to: a RETRY whose change finds the retries
used up (or the job failing fast) writes FAILED and is FAILED, one whose job pauses on a
failure writes PAUSED and is PAUSED (its own event, `attempt_failed`, then `paused`); a
change the record refuses means the run is over (STOPPED) or no longer ours (FENCED). A
fenced trainer answers nothing: the message is no longer its own, and a late ack could
delete the new holder's copy (docs/nats.md). Every other outcome frees the lease before
answering, so the next worker finds it free when the message reaches it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.bus.emit import emit
from shared.contracts import RunRecord, RunState
from shared.contracts.events import Event, Fenced, Paused
from shared.state.endings import settle
from shared.state.lease import Lease
from shared.state.runs import Change, Runs

log = logging.getLogger("baton.trainer")

MAX_RETRY_DELAY_S = 60.0


class Outcome(enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    ROLLED_BACK = "rolled_back"
    RETRY = "retry"
    FAILED = "failed"
    FENCED = "fenced"
    PAUSED = "paused"


_ENDED = {
    RunState.COMPLETED: Outcome.COMPLETED,
    RunState.FAILED: Outcome.FAILED,
    RunState.CANCELLED: Outcome.CANCELLED,
}


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    change: Change | None = None
    """The record change; it returns None where it no longer applies."""
    event: Callable[[RunRecord], Event] | None = None
    """The attempt's own event for a run that goes on, made from the written record."""
    reason: str = ""
    """Why: the fenced event's reason."""
    detail: str = ""
    """The log tail a failed run's event carries."""
    delay: float = 0.0
    """How long the message waits before its next delivery (PREEMPTED)."""
    quiet: bool = False
    """No event: an attempt that never started (its record had moved on)."""


@dataclass
class Scope:
    """What a verdict is carried out on."""

    js: JetStreamContext
    runs: Runs
    lease: Lease
    msg: Msg
    worker: str
    site: str = ""
    stop_keeping: Callable[[], Awaitable[None]] | None = None
    """Stops the lease's renewals: before the release, or a renewal would take it again."""
    give_up: Callable[[], bool] = field(default=lambda: False)
    """Stop retrying the record write (the attempt was fenced meanwhile)."""


async def apply(v: Verdict, s: Scope) -> Outcome:
    """Carry out `v`, returning the outcome it led to (see the table above)."""
    outcome, record = v.outcome, None
    if v.change is not None:
        record = await settle(
            s.js, s.runs, s.lease.run_id, v.change, site=s.site, detail=v.detail,
            give_up=s.give_up,
        )  # fmt: skip
        if record is None:
            found = await s.runs.get(s.lease.run_id)
            outcome = Outcome.STOPPED if found and found[0].state.terminal else Outcome.FENCED
        elif record.state is RunState.PAUSED:
            outcome = Outcome.PAUSED
        else:
            outcome = _ENDED.get(record.state, v.outcome)
    if outcome is Outcome.FENCED:
        if not v.quiet:
            reason = v.reason or "the run record moved on"
            fenced = Fenced(
                run_id=s.lease.run_id, worker=s.worker, token=s.lease.token, reason=reason
            )
            await emit(s.js, fenced, site=s.site)
        return outcome
    if record is not None and v.event is not None and outcome not in _ENDED.values():
        await emit(s.js, v.event(record), site=s.site)
    if record is not None and outcome is Outcome.PAUSED:
        why = record.pause_requested or "paused"
        paused = Paused(run_id=record.run_id, reason=why, step=record.step)
        await emit(s.js, paused, site=s.site, msg_id=f"paused.{record.run_id}.{record.attempts}")
    if s.stop_keeping is not None:
        await s.stop_keeping()
    await s.lease.release()
    await _answer(s.msg, outcome, _delay(outcome, v, record))
    return outcome


def _delay(outcome: Outcome, v: Verdict, record: RunRecord | None) -> float:
    if outcome is Outcome.RETRY and record is not None:
        return min(2.0**record.retries, MAX_RETRY_DELAY_S)
    return v.delay


async def _answer(msg: Msg, outcome: Outcome, delay: float) -> None:
    if outcome in (Outcome.PREEMPTED, Outcome.ROLLED_BACK, Outcome.RETRY):
        await msg.nak(delay=delay)
        return
    # The run record already says how it ended, so a lost ack only costs a redelivery
    # that is acked on sight.
    with contextlib.suppress(Exception):
        await msg.ack_sync(timeout=5)
