"""An operator's rollback (`baton rollback`), as the dispatcher takes it: checked against the
store, then written into the run record as an order.

Invariant: the dispatcher writes no checkpoint state. It checks that the step is a committed
checkpoint on the run's chain, by its manifest (`shared.checkpoint.lineage.find`), and
records the order (`transitions.order_rollback`). It reads no checkpoint file: `baton
rollback` verifies the files before it asks, and the checkpointer again as it rewinds (a
checkpoint damaged since is refused there, `rollback_refused`), so the requests queued behind
this one never wait on a checkpoint's download. The rewind itself is written later by the
checkpointer for the run's next attempt, under that attempt's token — higher than any the
run had — once the attempt that trained past the step was stopped (`services/trainer/
rewind.py`, `shared.checkpoint.rebase`). A request that cannot apply raises `ContractError`:
dead-lettered with its reason, nothing changed.

    run is        then
    QUEUED        ordered; its next attempt rewinds
    RUNNING       ordered and its trainer woken: the attempt stops without a checkpoint and
                  gives its task back (PREEMPTED); the next one rewinds
    PAUSED        ordered; the attempt after `baton resume` rewinds
    FAILED        reopened: QUEUED at the next dispatch, ordered, its task published; a
                  run with a price once its life is settled, as a new life with a new
                  hold for its steps from the checkpoint on (a balance short of it
                  refuses the rollback, nothing changed)
    COMPLETED,    refused: a run that is over is forked instead (`baton fork`)
    CANCELLED
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from shared import config
from shared.checkpoint import lineage
from shared.checkpoint.store import open_store
from shared.contracts import RunRecord, RunState
from shared.contracts.control import Rollback
from shared.errors import ContractError, IntegrityError, TransientError
from shared.state import transitions
from shared.state.runs import Runs

log = logging.getLogger("baton.dispatcher")

RETRY_S = 1.0


Reopen = Callable[[RunRecord, int], Awaitable[transitions.Taken | None]]
"""The first hold of a FAILED run's next life, back to a step, taken in the ledger."""


async def order(
    runs: Runs,
    req: Rollback,
    record: RunRecord,
    store_url: str | None = None,
    reopen: Reopen | None = None,
) -> RunRecord:
    """Check `req` and write the order; the record as ordered (a reopened run QUEUED, for
    the scheduler to admit). `store_url` defaults to the service's (`BATON_STORE`).
    `reopen`: what a FAILED run holds for its next life, taken once the step is checked
    (its refusal refuses the rollback, nothing changed)."""
    if record.state in (RunState.COMPLETED, RunState.CANCELLED):
        raise ContractError(
            f"run {req.run_id} is {record.state.value}: a run that is over does not go back; "
            f"fork it from step {req.step} instead (`baton fork`)",
            "$.run_id",
        )
    async with open_store(store_url or config.load().store_url) as store:
        try:
            await lineage.find(store, req.run_id, req.step, resumable=True, read=False)
        except IntegrityError as exc:
            raise ContractError(str(exc), "$.step") from None
    reason = req.reason or "rolled back by an operator"
    taken = None
    if record.state is RunState.FAILED and reopen is not None:
        taken = await reopen(record, req.step)
    ordered = await runs.update(req.run_id, transitions.order_rollback(req.step, reason, taken))
    if ordered is None:
        found = await runs.get(req.run_id)
        now = found[0] if found else None
        if now is not None and now.state is RunState.FAILED and now.announce_pending:
            raise TransientError(f"run {req.run_id}'s failure is still being announced", RETRY_S)
        state = now.state.value if now else "gone"
        raise ContractError(f"rollback does not apply to run {req.run_id} ({state})", "$.run_id")
    log.info(
        "%s: rollback to step %d ordered (%s, %s)",
        req.run_id, req.step, ordered.state.value, reason,
    )  # fmt: skip
    return ordered
