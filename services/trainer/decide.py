"""How an attempt's course ends: followed until something ends it, then its verdict decided
(`follow`), once, from the first of these to happen, strongest first:

    fenced (lease taken over, or the final commit refused)   -> FENCED, or YIELDED when
                                                                the store's chain is
                                                                another side's (`owner.py`)
    the run ended elsewhere (hard timeout)                   -> STOPPED
    the training process stalled (`stall.py`)                -> RETRY, FAILED or PAUSED
    asked to stop (cancel, pause, SIGTERM), the grace ran out -> CANCELLED, PAUSED or
                                                                PREEMPTED
    the divergence guard stopped the child (`guarded`)       -> by `guard.action`
    the child exited without finishing                       -> RETRY, FAILED or PAUSED
    the child stopped early after its checkpoint             -> CANCELLED, PAUSED or
                                                                PREEMPTED
    the child finished with its final checkpoint committed   -> COMPLETED

`verdicts` builds each verdict and carries it out (`verdicts.apply`, by the attempt)."""

from __future__ import annotations

import asyncio
import logging

from services.trainer import owner, rewind, verdicts
from services.trainer.child_proc import FINISH_GRACE_S
from services.trainer.course import Following
from services.trainer.keeper import Order
from services.trainer.verdicts import Outcome, Verdict
from shared.contracts.child import Control, Finished

log = logging.getLogger("baton.trainer")

CHECKPOINT_FIRST = (None, Order.PREEMPT, Order.PAUSE, Order.CANCEL)
"""What an attempt stops for with a checkpoint first (None: a SIGTERM or a drain)."""


async def follow(a: Following) -> Verdict:
    """Follow the child until something ends the attempt, then decide its verdict. A
    cancel or a SIGTERM first asks the child to checkpoint and stop, and waits the
    grace for it (or a stronger order, or a second signal)."""
    reader = asyncio.create_task(a.read_child())
    try:
        await _first(reader, a.orders.changed, a.stop, a.broken, a.grow_wanted)
        if a.broken.is_set() and a.orders.given is None:
            return await verdicts.group_broke(a, reader)
        if not reader.done() and a.orders.given in CHECKPOINT_FIRST:
            given = a.orders.given
            why = "preempted" if given is None else given.name.lower()
            if a.growing:
                assert a.group is not None
                why = f"growing onto {a.group.grower}"
            log.info("%s: %s at step %d; checkpointing", a.run_id, why, a.step)
            a.child.send(Control(action="stop"))
            a.stall.finish()  # the grace bounds it from here
            a.orders.changed.clear()  # from here on, set only by a stronger order
            await _first(
                reader, a.orders.changed, a.hurry, a.broken,
                timeout=a.settings.grace_s,
            )  # fmt: skip
            if a.broken.is_set() and a.orders.given in CHECKPOINT_FIRST:
                return await verdicts.group_broke(a, reader)
        if a.orders.given is Order.ROLLBACK:  # no checkpoint: it would be abandoned
            return rewind.handed_back(a)
        return await _decide(a, reader)
    finally:
        reader.cancel()

async def _decide(a: Following, reader: asyncio.Task[Finished | None]) -> Verdict:
    """The verdict, strongest cause first (the module's table)."""
    given = a.orders.given
    if given is Order.FENCE:
        return await owner.after_refusal(a) or verdicts.fenced(a, a.orders.reason)
    if given is Order.OVER:
        a.child.kill()
        log.warning("%s: stopped: %s", a.run_id, a.orders.reason)
        return Verdict(Outcome.STOPPED)
    if given is Order.STALL:
        a.child.kill()
        await a.output_copied()
        return verdicts.child_failed(a, -9, a.orders.reason, stall=a.stalled)
    if not reader.done():  # asked to stop, and the grace ran out (or a second signal)
        return await verdicts.stopped_early(a, None)
    finished = reader.result()
    if finished is None and a.group is not None:
        return await verdicts.group_broke(a, reader)
    if finished is None:
        code = await a.child.wait()
        await a.output_copied()
        return await verdicts.exited(a, code)
    # `Finished` comes after the child's last write; it then leaves promptly (no
    # interpreter teardown), so its exit is waited for, briefly: nothing is killed.
    if not await a.child.exit_or_kill():
        log.info("%s: the training process finished but did not exit within %.0fs; "
                 "stopped", a.run_id, FINISH_GRACE_S)  # fmt: skip
    if finished.stopped:
        return await verdicts.stopped_early(a, finished)
    verdict = await verdicts.finished(a)
    if verdict.outcome is Outcome.FENCED:  # its final commit refused: by whom?
        return await owner.after_refusal(a) or verdict
    return verdict


async def _first(
    *waits: asyncio.Task[object] | asyncio.Event, timeout: float | None = None
) -> None:
    """Until the first of `waits` is done or set (or `timeout`)."""
    tasks = [w if isinstance(w, asyncio.Task) else asyncio.create_task(w.wait()) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w, task in zip(waits, tasks, strict=True):
            if task is not w:
                task.cancel()
