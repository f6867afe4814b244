"""Before an attempt launches its training process: a rollback the run was ordered, or the
graft a fork starts from, done by the checkpointer under this attempt's token.

Invariant: `latest` moves back only under a token higher than every earlier attempt's — this
one's, taken after the attempt that trained past the step was stopped — and the training
process is launched only once the checkpointer answered, so it restores from what the rewind
(or graft) left; an attempt that cannot know that never trains (it gives its task back).

    record / spec                       asks the checkpointer    then
    `rollback_to` set                    rewind to that step      record: step, lineage
                                                                  (`rewinds`), order cleared
    a fork (`spec.fork`), no checkpoint  graft the parent's       —
    answered: refused, a rollback        —                        order dropped, `warning`
                                                                  (`rollback_refused`); the
                                                                  run goes on as it was
    answered: refused, a graft           —                        FAILED: the fork has no
                                                                  base (gone, damaged, or
                                                                  not the submitter's run)
    not answered (SIGTERM, or none in    —                        task given back
    `ANSWER_WAIT_S`)                                               (PREEMPTED, no checkpoint)
    the lease lost, a newer `latest`     —                        fenced

While it waits, the attempt keeps its lease and its task (the keeper starts only with the
training process). The answer is the checkpointer's event (`rolled_back`, `forked`,
`commit_refused` for this token) or, when an event is missed, the store's `latest`.

A running attempt is stopped for a rollback by its keeper (`Order.ROLLBACK`): it is killed
without a checkpoint — one past the step would be abandoned anyway — and gives its task back
at once (`handed_back`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from services.trainer.keeper import Order
from services.trainer.verdicts import Outcome, Verdict
from shared.bus import names
from shared.bus.connect import publish
from shared.checkpoint import commit, retention
from shared.contracts import CommitRequest, Pointer, RunRecord, RunState, decode, encode, spec_hash
from shared.contracts.checkpoints import Base
from shared.contracts.events import (
    CommitRefused,
    Event,
    Forked,
    Preempted,
    RolledBack,
    RunWarning,
)
from shared.contracts.records import Rewind
from shared.errors import ContractError
from shared.state import transitions
from shared.state.endings import settle

if TYPE_CHECKING:
    from services.trainer.course import AttemptView

log = logging.getLogger("baton.trainer")

ANSWER_WAIT_S = 900.0
"""How long an attempt waits for the checkpointer's answer (a graft copies and verifies a
whole checkpoint) before it gives its task back."""
POLL_S = 2.0
"""How often the store is asked, in case the answer's event was missed."""
RETRY_DELAY_S = 5.0
"""How long a task given back unanswered waits before its next delivery."""

Latest = tuple[Pointer, str] | None
Answer = RolledBack | Forked | CommitRefused | Pointer

_delays: weakref.WeakKeyDictionary[AttemptView, float] = weakref.WeakKeyDictionary()


async def prepare(a: AttemptView, msg: Msg, record: RunRecord, latest: Latest) -> Latest:
    """The `latest` the attempt starts from: after the rollback or graft it had done, if any
    (the module's table). Orders the attempt stopped (`a.orders`) where it must not train."""
    spec = a.task.spec
    if record.rollback_to is not None:
        reason = record.rollback_reason or ""
        base = Base(run_id=a.run_id, step=record.rollback_to, reason=reason)
    elif latest is None and spec.fork is not None:
        base = Base(run_id=spec.fork.run_id, step=spec.fork.step, spec_hash=spec_hash(spec))
        if base.step >= spec.total_steps:
            await _refused_graft(a, base, f"total_steps is {spec.total_steps}: nothing to train")
            return latest
    else:
        return latest
    answer = await _ask(a, msg, base)
    if answer is None:
        return latest  # an order is given: the attempt stops without training
    now = await commit.read_latest(a.store, a.run_id)
    if now is not None and now[0].token > a.token:
        a.orders.fence(f"latest names token {now[0].token}, newer than {a.token}")
        return now
    if not isinstance(answer, CommitRefused):
        if base.run_id == a.run_id:
            await _rewound(a, answer, base)
        else:
            log.info("%s: forked from %s at step %d", a.run_id, base.run_id, base.step)
            await a.runs.update(a.run_id, transitions.advance_step(a.token, base.step))
        return now
    if base.run_id == a.run_id:
        await _refused_rollback(a, base, answer.reason)
    elif now is None:
        await _refused_graft(a, base, answer.reason)
    return now


def handed_back(a: AttemptView) -> Verdict:
    """The verdict of an attempt stopped for a rollback (`Order.ROLLBACK`): killed without a
    checkpoint, its task given back — at once when the record ordered it, after a pause when
    the checkpointer did not answer."""
    a.child.kill()
    step, reason = a.step, a.orders.reason
    log.info("%s: %s; training process stopped at step %d", a.run_id, reason, step)

    def preempted(r: RunRecord) -> Event:
        return Preempted(run_id=a.run_id, worker=a.worker, step=step, reason=reason)

    released = transitions.release(a.spent())
    delay = _delays.pop(a, 0.0)
    return Verdict(Outcome.PREEMPTED, change=released, event=preempted, delay=delay)


async def _ask(a: AttemptView, msg: Msg, base: Base) -> Answer | None:
    """Publish the request and wait for its answer, keeping the lease and the task. None
    once the attempt was told to stop instead (fenced, or given back)."""
    token, got = a.token, asyncio.get_running_loop().create_future()

    async def heard(m: Msg) -> None:
        with contextlib.suppress(ContractError):
            event: Event = decode(m.data, Event)
            if _answers(event, token, base.step) and not got.done():
                got.set_result(event)

    sub = await a.nc.subscribe(names.at_site(names.events_of_run(a.run_id), a.site), cb=heard)
    try:
        req = CommitRequest(
            run_id=a.run_id, token=token, step=base.step, worker=a.worker, files=[],
            keep_last=a.task.spec.checkpoint.keep_last, base=base, side=a.side,
        )  # fmt: skip
        what = "rollback" if base.run_id == a.run_id else "graft"
        log.info("%s: asking for a %s to step %d under token %d", a.run_id, what, base.step, token)
        await publish(
            a.js, names.at_site(names.commit_subject(a.run_id), a.site), encode(req),
            msg_id=f"rebase.{a.run_id}.{token}",
        )  # fmt: skip
        return await _wait(a, msg, got, base)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _answers(event: Event, token: int, step: int) -> bool:
    if isinstance(event, RolledBack | Forked):
        return event.token == token
    return isinstance(event, CommitRefused) and event.token == token and event.step == step


async def _wait(a: AttemptView, msg: Msg, got: asyncio.Future[Answer], base: Base) -> Answer | None:
    deadline = time.monotonic() + ANSWER_WAIT_S
    beat = a.lease.ttl_s / 3
    renewed = time.monotonic()
    while True:
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(got), min(POLL_S, beat))
        if a.stop.is_set() or time.monotonic() > deadline:
            why = "stopping" if a.stop.is_set() else f"no answer in {ANSWER_WAIT_S:.0f}s"
            _delays[a] = 0.0 if a.stop.is_set() else RETRY_DELAY_S
            a.orders.give(Order.ROLLBACK, f"its rollback or graft not done ({why})")
            return None
        if time.monotonic() - renewed >= beat:
            renewed = time.monotonic()
            with contextlib.suppress(Exception):  # a link that is down: keep the lease's TTL
                await msg.in_progress()
                if not await a.lease.renew():
                    a.orders.fence("the lease was lost while waiting for the checkpointer")
                    return None
        with contextlib.suppress(Exception):  # the store may be down too: ask again
            now = await commit.read_latest(a.store, a.run_id)
            if now is not None and now[0].token == a.token and now[0].step == base.step:
                return now[0]
            if now is not None and now[0].token > a.token:
                return now[0]  # `prepare` fences


async def _rewound(a: AttemptView, answer: Answer, base: Base) -> None:
    """Record the rollback that was done: its lineage, the run's step, the order cleared."""
    if isinstance(answer, RolledBack):
        done = Rewind(
            token=answer.token, from_step=answer.from_step, to_step=answer.to_step,
            abandoned=answer.abandoned, reason=answer.reason,
        )  # fmt: skip
    else:  # heard from the store: its note says what the event would have
        notes = await retention.rewinds(a.store, a.run_id, a.token)
        note = max(notes, key=lambda n: (n.from_token, n.from_step), default=None)
        done = Rewind(
            token=a.token, from_step=note.from_step if note else base.step, to_step=base.step,
            abandoned=[commit.step_of(k) for k in note.abandoned] if note else [],
            reason=base.reason,
        )  # fmt: skip
    log.info(
        "%s: rolled back from step %d to %d under token %d; abandoned %s",
        a.run_id, done.from_step, done.to_step, a.token, done.abandoned or "none",
    )  # fmt: skip
    if await a.runs.update(a.run_id, transitions.rewound(a.token, done)) is None:
        await _moved_on(a)


async def _refused_rollback(a: AttemptView, base: Base, reason: str) -> None:
    """The checkpoint at the step is gone or damaged since the order was taken: the run goes
    on from where it was, and says so."""
    log.warning("%s: rollback to step %d refused: %s", a.run_id, base.step, reason)
    if await a.runs.update(a.run_id, transitions.drop_rollback(a.token, base.step)) is None:
        await _moved_on(a)
        return
    detail = f"rollback to step {base.step} refused, the run goes on: {reason}"
    await a.reports.emit(RunWarning(run_id=a.run_id, kind="rollback_refused", detail=detail))


async def _refused_graft(a: AttemptView, base: Base, reason: str) -> None:
    """The fork's base cannot be had: the run fails, for good (its spec names it)."""
    why = f"cannot fork {base.run_id} at step {base.step}: {reason}"
    log.warning("%s: %s", a.run_id, why)
    token, fail = a.token, transitions.fail(why)

    def ours(r: RunRecord) -> RunRecord | None:
        return fail(r) if r.token == token else None

    ended = await settle(a.js, a.runs, a.run_id, ours, site=a.site)
    if ended is None:
        await _moved_on(a)
        return
    a.orders.give(Order.OVER, why)


async def _moved_on(a: AttemptView) -> None:
    """The record refused this attempt's change: the run is over, or someone newer has it."""
    found = await a.runs.get(a.run_id)
    if found is not None and found[0].state in (RunState.COMPLETED, RunState.CANCELLED):
        a.orders.give(Order.OVER, f"the run is {found[0].state.value}")
    elif found is not None and found[0].state is RunState.FAILED:
        a.orders.give(Order.OVER, found[0].reason or "the run failed")
    else:
        a.orders.fence("the run record moved on while the attempt was rolled back")
