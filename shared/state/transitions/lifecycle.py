"""How a run's record moves through its life beside an attempt: ended, failed, cancelled,
paused and resumed, handed over, rolled back (`baton rollback`), its ending announced."""

from __future__ import annotations

import msgspec

from shared.contracts import RunRecord, RunState
from shared.contracts.records import MAX_REWINDS, Rewind
from shared.state.runs import Change
from shared.state.transitions.attempts import book_committed

_replace = msgspec.structs.replace


class Taken(msgspec.Struct, frozen=True):
    """A hold the dispatcher took in the ledger for a run: hold number `n` of its life
    `life`, of `amount` units (`shared.ledger.holds`), for its record to add."""

    life: int
    n: int
    amount: int


# -- ending, cancelling, stopping -------------------------------------------------------


def fail(reason: str) -> Change:
    """Unless the run is over: FAILED for `reason`, nobody holds it (no trainer will run
    it: its entry point was refused, or its task used up its deliveries)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal:
            return None
        return _replace(r, state=RunState.FAILED, reason=reason, worker=None)

    return change


def end(state: RunState, reason: str) -> Change:
    """Unless the run is over: `state` (terminal) for `reason`, `worker` kept so that its
    trainer can be told to stop (the reaper's hard timeout, a lost run's cancel)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal:
            return None
        return _replace(r, state=state, reason=reason)

    return change


def cancel(reason: str) -> Change:
    """A QUEUED run the hub holds, or a PAUSED one: CANCELLED for `reason` (one paused while
    granted to a site is the hub's again, under the next epoch: nothing trains a PAUSED run,
    and only the hub resumes one). A RUNNING one, or a QUEUED one granted to a site, not
    asked yet: asked to cancel (`cancel_requested`; its trainer checkpoints and stops, or
    the site cancels it when it takes it). Otherwise None."""

    def change(r: RunRecord) -> RunRecord | None:
        if _untrained(r):
            return _cancelled(r, reason)
        if (r.state is RunState.RUNNING or r.site) and r.cancel_requested is None:
            # Granted to a site, the run is the site's to end: asked, like a running one.
            return None if r.state.terminal else _replace(r, cancel_requested=reason)
        return None

    return change


def cancel_untrained(r: RunRecord) -> RunRecord | None:
    """While the run is asked to cancel and nothing trains it — QUEUED or PAUSED at the hub,
    or PAUSED at a site —: CANCELLED for the reason asked; one granted to a site is the
    hub's again under the next epoch (the site's grant is spent). Otherwise None."""
    if r.cancel_requested is None or not _untrained(r):
        return None
    return _cancelled(r, r.cancel_requested)


def _cancelled(r: RunRecord, reason: str) -> RunRecord:
    if r.site:
        r = _replace(r, site="", epoch=r.epoch + 1, delivery=None, worker=None, group=[])
    return _replace(r, state=RunState.CANCELLED, reason=reason)


def _untrained(r: RunRecord) -> bool:
    """Nothing trains the run, nor will until the hub says: QUEUED or PAUSED at the hub, or
    PAUSED at a site."""
    if r.state is RunState.PAUSED:
        return True
    return r.state is RunState.QUEUED and not r.site


def pause(reason: str) -> Change:
    """A QUEUED run the hub holds: PAUSED for `reason` (its queued task is then deleted). A
    RUNNING one, or one granted to a site, not asked yet: asked to pause (`pause_requested`;
    its trainer checkpoints and stops, and the run is PAUSED). Otherwise None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is RunState.QUEUED and not r.site:
            return _replace(r, state=RunState.PAUSED, pause_requested=reason)
        if r.state in (RunState.RUNNING, RunState.QUEUED) and r.pause_requested is None:
            return _replace(r, pause_requested=reason)
        return None

    return change


def resume(hold: Taken | None = None, *, allow_changes: bool = False) -> Change:
    """A PAUSED run not settled: QUEUED at the next dispatch, waiting for the scheduler to
    admit it, no longer asked to pause, its failures forgiven (a human looked); with
    `hold`, that hold added (taken in the ledger first: `add_hold`); with `allow_changes`,
    allowed to resume under other software (`changes_allowed`). A run paused while granted
    to a site is the hub's again, under the next epoch: the site's grant was spent (its
    record there stays PAUSED, and a grant is sent once per epoch), so the scheduler
    decides afresh, and may grant it again. A run asked to cancel is not resumed. Otherwise
    None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.PAUSED or r.settled or r.cancel_requested is not None:
            return None  # (one asked to cancel is the reaper's to end: `cancel_untrained`)
        if hold is not None:
            added = add_hold(hold)(r)
            if added is None:
                return None
            r = added
        if r.site:
            r = _replace(r, site="", epoch=r.epoch + 1, delivery=None)
        return _replace(
            r, state=RunState.QUEUED, dispatch=r.dispatch + 1, pause_requested=None, retries=0,
            worker=None, group=[], admitted=False, preempt=None, ranks_cap=None,
            changes_allowed=r.changes_allowed or allow_changes,
        )  # fmt: skip

    return change


def add_hold(hold: Taken) -> Change:
    """While the run is not over nor settled, in life `hold.life`, and holds `hold.n`
    holds: that hold added (its ledger entry is written first, once: `shared.ledger`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.settled or r.life != hold.life or len(r.holds) != hold.n:
            return None
        return _replace(r, holds=[*r.holds, hold.amount])

    return change


def warn(kind: str) -> Change:
    """Unless the run is over or was warned of `kind` already: `kind` added to `warned`."""

    def change(r: RunRecord) -> RunRecord | None:
        if kind not in r.warned and not r.state.terminal:
            return _replace(r, warned=[*r.warned, kind])
        return None

    return change


def redispatch(dispatch: int) -> Change:
    """While the run is RUNNING at dispatch number `dispatch` (nobody moved it on since it
    was found lost): the next dispatch, nobody holds it."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.RUNNING or r.dispatch != dispatch:
            return None
        return _replace(r, dispatch=r.dispatch + 1, worker=None)

    return change


def hand_over(token: int) -> Change:
    """While the run is RUNNING under `token`, held by a worker, with a task delivery still
    unanswered: the delivery cleared (whoever clears it naks it, `shared.state.handover`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.RUNNING or r.token != token or r.worker is None:
            return None
        if not r.delivery:
            return None
        return _replace(r, delivery=None)

    return change


# -- rolling a run back (`baton rollback`) ----------------------------------------------


def order_rollback(step: int, reason: str, reopen: Taken | None = None) -> Change:
    """A QUEUED, RUNNING or PAUSED run: ordered back to its committed checkpoint at `step`
    (`rollback_to`: the attempt running stops without a checkpoint, and the next one rewinds
    `latest` before it starts). A FAILED run whose failure was announced: reopened — QUEUED
    at the next dispatch, for the scheduler to admit, its failures forgiven — and ordered
    the same way. A FAILED run with a price is reopened only once its life is settled, and
    only with `reopen`, the first hold of its next life (`reopen.life`, `n` 0): it begins
    that life, its holds that one, metered from now, to be settled on its own. A COMPLETED
    or CANCELLED run, a FAILED one whose failure is still being announced, or a priced one
    not settled yet or without its next life's hold: None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is RunState.FAILED and not r.announce_pending:
            if r.price and r.owner:
                if not r.settled or reopen is None:
                    return None
                if reopen.life != r.life + 1 or reopen.n != 0:
                    return None
                r = book_committed(r)
                r = _replace(
                    r, life=reopen.life, holds=[reopen.amount], settled=False,
                    metered_before=r.metered_s,
                )  # fmt: skip
            return _replace(
                r, state=RunState.QUEUED, dispatch=r.dispatch + 1, retries=0, reason=None,
                worker=None, group=[], delivery=None, rollback_to=step, rollback_reason=reason,
                admitted=False,
            )  # fmt: skip
        if r.state.terminal:
            return None
        return _replace(r, rollback_to=step, rollback_reason=reason)

    return change


def rewound(token: int, done: Rewind) -> Change:
    """While the run is not over and names `token` (the attempt that rewound it): its newest
    committed checkpoint is at `done.to_step`, `done` joins its lineage, the divergence
    guard's data left out after later checkpoints is forgotten (those checkpoints are
    abandoned: the run trains through that data again), and the order is cleared — unless it
    names another step by now (a second rollback, asked meanwhile, is the next attempt's)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != token:
            return None
        same = r.rollback_to == done.to_step
        return _replace(
            r, step=done.to_step, rewinds=[*r.rewinds, done][-MAX_REWINDS:],
            skips=[s for s in r.skips if s.after <= done.to_step],
            rollback_to=None if same else r.rollback_to,
            rollback_reason=None if same else r.rollback_reason,
        )  # fmt: skip

    return change


def drop_rollback(token: int, step: int) -> Change:
    """While the run is not over, names `token` and is ordered back to `step`: the order
    cleared, the run going on from where it was (its checkpoint at `step` was refused: gone
    or damaged since the order was taken)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != token or r.rollback_to != step:
            return None
        return _replace(r, rollback_to=None, rollback_reason=None)

    return change


# -- announcing an ending (`shared.state.endings`) --------------------------------------


def mark_ending(change: Change, site: str) -> Change:
    """As `change`; a record it leaves terminal is also marked `announce_pending`, with the
    `site` whose outbox carries the terminal event."""

    def stamp(r: RunRecord) -> RunRecord | None:
        new = change(r)
        if new is None or not new.state.terminal:
            return new
        return _replace(new, announce_pending=True, ending_site=site)

    return stamp


def announced(r: RunRecord) -> RunRecord | None:
    """While the record is marked `announce_pending`: the mark cleared (its event is
    stored)."""
    if not r.announce_pending:
        return None
    return _replace(r, announce_pending=False)
