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
    REQUEUED   QUEUED for the scheduler (it made   preempted         released  ack
               room for another run)
    ROLLED_BACK  as PREEMPTED, data to leave out   (guarded)         released  nak(0)
    RETRY      retries + 1                         attempt_failed    released  nak(back-off)
    FAILED     FAILED (retries used up, or fail    failed.<run>      released  ack
               fast)
    PAUSED     PAUSED (asked, the policy, or a     paused            released  ack
               resume under other software)
    YIELDED    the store's chain is another side's: superseded        released  ack
               the record follows it (`owner.py`)
    FENCED     none                                fenced            kept      none

The record decides the outcome the change leads to: a RETRY whose change finds the retries
used up (or the job failing fast) writes FAILED and is FAILED, one whose job pauses on a
failure writes PAUSED and is PAUSED (its own event, `attempt_failed`, then `paused`); a
change the record refuses means the run is over (STOPPED) or no longer ours (FENCED). A
fenced trainer answers nothing: the message is no longer its own, and a late ack could
delete the new holder's copy (docs/nats.md). Every other outcome frees the lease before
answering, so the next worker finds it free when the message reaches it.

The verdicts an attempt decides are built here too (`finished`, `stopped_early`, `exited`,
`guarded`, `changed`, `fenced`, `group_broke`, `rank_lost`, `child_failed`), beside the
table they follow, from what the attempt holds; which one applies is `decide`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace

from services.trainer.child_proc import tail_of
from services.trainer.faults import MACHINE, SILENT, fault_of
from services.trainer.keeper import Order
from shared.bus.emit import emit
from shared.checkpoint import commit
from shared.contracts import RunRecord, RunState, Skip
from shared.contracts.child import (
    EXIT_BAD_LAUNCH,
    EXIT_CHANGED,
    EXIT_GROUP_BROKEN,
    EXIT_GUARDED,
    Finished,
    Tripped,
)
from shared.contracts.events import AttemptFailed, Event, Fenced, Paused, Preempted, RankLost
from shared.contracts.records import Preemption, Stall
from shared.state import transitions
from shared.state.endings import settle
from shared.state.lease import Lease
from shared.state.runs import Change, Runs

if TYPE_CHECKING:
    from services.trainer.course import AttemptView
    from services.trainer.group import Breakage

log = logging.getLogger("baton.trainer")

MAX_RETRY_DELAY_S = 60.0
FINAL_COMMIT_WAIT_S = 900.0


class Outcome(enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    REQUEUED = "requeued"
    ROLLED_BACK = "rolled_back"
    RETRY = "retry"
    FAILED = "failed"
    FENCED = "fenced"
    PAUSED = "paused"
    YIELDED = "yielded"


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


# -- the verdicts an attempt decides (`decide.follow`, strongest cause first) ------------


async def finished(a: AttemptView) -> Verdict:
    final = a.last_checkpoint
    if final is None or not final.final:
        return child_failed(a, 0, "the entry point ended without its final checkpoint")
    if not await a.commits.wait(final.token, final.step, FINAL_COMMIT_WAIT_S):
        return fenced(a, f"final commit at step {final.step} was refused")
    log.info("%s: completed at step %d, digest %s", a.run_id, final.step, final.digest[:16])
    done = transitions.complete(a.spent(), final.step, final.digest, final.metrics)
    return Verdict(Outcome.COMPLETED, change=done)


async def stopped_early(a: AttemptView, ended: Finished | None) -> Verdict:
    """Preempted (SIGTERM) or cancelled: the child checkpointed and returned (or was
    killed when the grace ran out)."""
    if ended is None:
        a.child.kill()
    last = a.last_checkpoint
    # The record's step follows commits as their events arrive; a commit heard of only
    # from the store (or whose event is still being handled) is written here.
    kept: int | None = None
    grace = a.settings.grace_s
    if ended is not None and last is not None:
        kept = last.step if await a.commits.wait(last.token, last.step, grace) else None
    if a.orders.given is Order.CANCEL:
        if not a.side:  # sealed before the record ends: a site training it commits no more
            await commit.seal(a.store, a.run_id, "cancelled")
        cancelled = transitions.cancel_attempt(a.spent(), a.orders.reason, kept)
        return Verdict(Outcome.CANCELLED, change=cancelled)
    if a.orders.given is Order.PAUSE:
        paused = transitions.pause_attempt(a.spent(), a.orders.reason, kept)
        return Verdict(Outcome.PAUSED, change=paused)
    if a.orders.given is Order.PREEMPT and a.orders.preemption is not None:
        return made_room(a, a.orders.preemption, last.step if last else 0, kept)
    step = last.step if last else 0
    why = a.leaving() if a.stop.is_set() else ""
    if a.growing:
        # The group forms again at once, larger (its `Resized` event says so).
        assert a.group is not None
        why = f"to grow its group onto {a.group.grower}"
    log.info("%s: preempted (%s); lease released after step %d", a.run_id, why or "-", step)

    def preempted(r: RunRecord) -> Event:
        return Preempted(run_id=a.run_id, worker=a.worker, step=step, reason=why)

    released = transitions.release(a.spent(), kept)
    return Verdict(Outcome.PREEMPTED, change=released, event=preempted)


def made_room(a: AttemptView, p: Preemption, step: int, kept: int | None) -> Verdict:
    """The scheduler asked the run to make room for run `p.by`, and it checkpointed: it is
    queued again (its task acked: the scheduler publishes a new one when its turn comes),
    or its elastic group re-forms at once with `p.to_ranks` ranks (its task back)."""
    log.info("%s: made room for %s at step %d (%s)", a.run_id, p.by, step, p.reason)

    def preempted(r: RunRecord) -> Event:
        return Preempted(
            run_id=a.run_id, worker=a.worker, step=step, reason=p.reason, by=p.by,
            kind=p.kind, to_ranks=p.to_ranks,
        )  # fmt: skip

    if p.to_ranks:
        released = transitions.release(a.spent(), kept)
        return Verdict(Outcome.PREEMPTED, change=released, event=preempted)
    return Verdict(Outcome.REQUEUED, change=transitions.requeue(a.spent(), kept), event=preempted)


async def guarded(a: AttemptView, t: Tripped) -> Verdict:
    """The divergence guard stopped the training process at step `t.step`, once the
    checkpoints of the steps before it were written: those are good, and are committed
    before the job's `guard.action` decides. A rollback needs a run of one rank (the
    ranks of a group would each have to leave out their own batches) and is allowed
    `guard.max_rollbacks` times; past either, the guard stops the run instead."""
    guard = a.task.spec.guard
    last = a.last_checkpoint
    if last is not None:
        await a.commits.wait(last.token, last.step, a.settings.grace_s)
    latest = await commit.read_latest(a.store, a.run_id)
    good = latest[0].step if latest else 0
    action = guard.action
    spent = len(a.skips) >= guard.max_rollbacks
    if action == "rollback" and (a.group is not None or spent):
        why = "a group's" if a.group is not None else f"{len(a.skips)} rollbacks"
        log.warning("%s: no rollback (%s): the guard stops the run", a.run_id, why)
        action = "stop"
    await a.reports.guarded(t, action, good)
    reason = f"divergence guard: {t.metric} = {t.value} at step {t.step} ({t.rule})"
    if action == "pause":
        return Verdict(Outcome.PAUSED, change=transitions.pause_attempt(a.spent(), reason))
    if action == "rollback":
        skip = Skip(after=good, batches=t.step - good)
        rolled = transitions.roll_back(a.spent(), skip)
        return Verdict(Outcome.ROLLED_BACK, change=rolled)
    return child_failed(a, EXIT_GUARDED, reason)


def fenced(a: AttemptView, reason: str) -> Verdict:
    a.child.kill()
    log.warning("%s: fenced (%s); training process killed", a.run_id, reason)
    trace.get_current_span().set_attribute("baton.reason", reason)
    return Verdict(Outcome.FENCED, reason=reason)


async def group_broke(a: AttemptView, reader: asyncio.Task[Finished | None]) -> Verdict:
    """A rank of the group is gone or failed (or rank 0's own process ended without
    finishing): every rank stops, and once each one's end is known, the group's verdict
    is decided — a lost rank re-forms the group (not the user's failure), a failure in
    some rank's code is a failed attempt with that rank's traceback."""
    assert a.group is not None
    reader.cancel()
    a.child.kill()
    code = await a.child.wait()
    await a.output_copied()
    if code == EXIT_BAD_LAUNCH or not a.group.key.formed:
        # Rank 0's process ended before any other rank started: its own failure.
        return child_failed(a, code)
    if (held := await _held_back(a, code)) is not None:
        return held
    own_tail = tail_of(a.log_path)
    cause = await a.group.settle(code, own_tail)
    if cause.user:
        return child_failed(a, code, cause.reason, tail=cause.tail, rank=cause.rank)
    return await rank_lost(a, cause)


async def rank_lost(a: AttemptView, cause: Breakage) -> Verdict:
    """A rank lost re-forms the group, uncounted — unless the group broke the time before
    too, with no checkpoint committed since: two breaks from one checkpoint are taken for a
    rank's code that hangs (its peers' collective timed out) rather than two machines lost,
    and the attempt fails, which the run's failure policy answers. (A real second loss that
    soon costs one counted retry.)"""
    epoch, step = a.lease.token, a.step
    kept = a.commits.newest[0]
    found = await a.runs.get(a.run_id)
    if found is not None and found[0].broke_at == kept:
        why = (
            f"the group broke again before any checkpoint past step {kept} (rank {cause.rank},"
            f" {cause.worker}: {cause.reason}): a rank's code hangs"
        )
        fault = MACHINE if cause.reason == SILENT else ""  # counted; a machine's: not charged
        return child_failed(a, EXIT_GROUP_BROKEN, why, tail=cause.tail, rank=cause.rank,
                            fault=fault)  # fmt: skip
    log.warning(
        "%s: rank %d (%s) lost at step %d: %s; the group forms again",
        a.run_id, cause.rank, cause.worker, step, cause.reason,
    )  # fmt: skip

    def lost(r: RunRecord) -> Event:
        return RankLost(
            run_id=a.run_id, worker=a.worker, epoch=epoch, rank=cause.rank,
            lost=cause.worker, reason=cause.reason, step=step,
        )  # fmt: skip

    return Verdict(Outcome.PREEMPTED, change=transitions.lose_rank(a.spent(), kept), event=lost)


async def exited(a: AttemptView, code: int) -> Verdict:
    """The training process exited without its `Finished`: stopped by the divergence guard,
    refused a resume under other software, or failed."""
    return await _held_back(a, code) or child_failed(a, code)


async def _held_back(a: AttemptView, code: int) -> Verdict | None:
    """The verdict when the run's own checks stopped its training process (the divergence
    guard, a resume under other software), whether alone or in a group; None otherwise."""
    if code == EXIT_GUARDED and a.tripped is not None:
        return await guarded(a, a.tripped)
    if code == EXIT_CHANGED:
        return changed(a)
    return None


def changed(a: AttemptView) -> Verdict:
    """A deterministic run would have resumed under other software than its checkpoint
    recorded, and its operator had not allowed it (`baton.runtime.compat`): PAUSED, saying
    what changed, before any step. Not a failure of the run's code: nothing is counted."""
    said = tail_of(a.log_path).strip().splitlines()
    why = said[-1].removeprefix("baton: ") if said else "resumed under other software"
    return Verdict(Outcome.PAUSED, change=transitions.pause_attempt(a.spent(), why))


def child_failed(
    a: AttemptView, code: int, why: str = "", *, tail: str | None = None, rank: int | None = None,
    stall: Stall | None = None, fault: str = "",
) -> Verdict:  # fmt: skip
    a.child.kill()
    reason = why or (
        "the entry point could not be loaded"
        if code == EXIT_BAD_LAUNCH
        else f"training process exited with code {code}"
    )
    tail = tail_of(a.log_path) if tail is None else tail
    fault = fault or fault_of(code, tail)
    trace.get_current_span().set_status(trace.StatusCode.ERROR, reason)
    # The token as the change applies: a lapsed lease re-taken meanwhile moves it.
    count = transitions.count_failure(
        lambda: a.lease.token, a.spent(own_failure=True), reason, fatal=code == EXIT_BAD_LAUNCH,
        stall=stall,
    )

    def failed(r: RunRecord) -> Event:
        return AttemptFailed(
            run_id=a.run_id, worker=a.worker, attempt=r.attempts, reason=reason,
            detail=tail, rank=rank, fault=fault,
        )  # fmt: skip

    return Verdict(Outcome.RETRY, change=count, event=failed, detail=tail)
