"""Every way a run's record may move: named, pure record changes for `Runs.update`.

A record changes only by compare-and-swap (`Runs.update`), through a `Change`: a function of
the newest record that returns the changed record, or None when the change no longer applies
(the run is over, someone newer holds it, someone else made the change first). Each function
here is one such change, or makes one from what its writer knows; none reads anything but
its arguments and the record, so a retried CAS applies it again to the newer record.

Two guards recur. *Not over*: a terminal record is never changed (apart from clearing its
announcement mark, and an operator's rollback reopening a FAILED run once its failure was
announced), so exactly one writer ends a run (`shared.state.endings`). *Still ours*:
an attempt's change applies only while the record names its token (to start or to wait: no
newer one), so a fenced attempt writes nothing.

    who            transitions
    dispatcher     cancel, pause, resume, order_rollback, add_hold (a resume's hold)
    scheduler      admit, queued_because, ask_preempt, cap_ranks (in the dispatcher:
                   `shared.scheduling`)
    trainer        mark_running, advance_step, retoken, wait, note_waiting, complete,
                   cancel_attempt, pause_attempt, release, requeue, roll_back,
                   count_failure, fail (entry point refused), pause_unowned,
                   cancel_unowned, requeue_unowned, unchanged, rewound and drop_rollback
                   (a rollback), yield_to and past_store (the store decides:
                   `shared.state.owner`)
    reaper         end, fail (deliveries used up), warn, redispatch, pause_unowned,
                   take_back and reconcile (a site's grant), settled (the ledger)
    delegator      delegate (the scheduler granting queued runs to sites)
    site trainer   accept_grant, forward_requests, and the trainer's own, on the site's
                   records of the runs granted to it
    anyone         hand_over (a dead attempt's task), mark_ending and announced (endings)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from shared.contracts import RunRecord, RunState, Skip
from shared.contracts.records import MAX_REWINDS, Preemption, Rewind, Stall
from shared.state.runs import Change

__all__ = [
    "Change",
    "Spent",
    "accept_grant",
    "add_hold",
    "admit",
    "advance_step",
    "announced",
    "ask_preempt",
    "book_time",
    "cancel",
    "cancel_attempt",
    "cancel_unowned",
    "cap_ranks",
    "complete",
    "count_failure",
    "delegate",
    "drop_rollback",
    "end",
    "fail",
    "forward_requests",
    "grantable",
    "hand_over",
    "mark_ending",
    "mark_running",
    "note_waiting",
    "order_rollback",
    "past_store",
    "pause",
    "pause_attempt",
    "pause_unowned",
    "queued_because",
    "reconcile",
    "redispatch",
    "release",
    "requeue",
    "requeue_unowned",
    "resume",
    "retoken",
    "rewound",
    "roll_back",
    "settled",
    "take_back",
    "unchanged",
    "wait",
    "warn",
    "yield_to",
]

_replace = msgspec.structs.replace


# -- starting and holding an attempt ----------------------------------------------------


def mark_running(
    worker: str, token: int, delivery: str | None, group: list[str], site: str = ""
) -> Change:
    """Unless the run is over, a newer token holds it, it is granted elsewhere than to
    `site` ("" = the hub) or it waits for the scheduler (not admitted): RUNNING under
    `worker` and `token`, one more attempt, answering `delivery`, trained by `group` (its
    workers by rank, [] for one rank), no longer waiting nor asked to make room."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.state is RunState.PAUSED or (r.token or 0) > token:
            return None
        if r.site != site or (r.state is RunState.QUEUED and not r.admitted):
            return None
        # A shrink is done once the smaller group trains; a whole preemption never gets here.
        return _replace(
            r, state=RunState.RUNNING, worker=worker, token=token, attempts=r.attempts + 1,
            delivery=delivery, waiting=None, group=group, group_size=len(group) or 1,
            preempt=None,
        )  # fmt: skip

    return change


def advance_step(token: int, step: int) -> Change:
    """While the run is not over, names `token` and is behind `step`: its newest committed
    checkpoint is at `step`."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.token != token or r.step >= step or r.state.terminal:
            return None
        return _replace(r, step=step)

    return change


def retoken(old: int, new: int) -> Change:
    """While the run is not over and still names `old` (a lapsed lease re-taken, nobody
    moved the run meanwhile): it names `new`."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != old:
            return None
        return _replace(r, token=new)

    return change


def wait(why: str, token: int) -> Change:
    """Unless the run is over or a newer token holds it: its group did not form (a leader
    giving its task back), `waiting` says `why`."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.token or 0) > token:
            return None
        return _replace(r, waiting=why)

    return change


def note_waiting(why: str, token: int) -> Change:
    """As `wait`, but None when `waiting` already says `why` (a forming group's advisory
    note, written only when it changes)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.token or 0) > token or r.waiting == why:
            return None
        return _replace(r, waiting=why)

    return change


# -- an attempt's verdict ---------------------------------------------------------------


class Spent(NamedTuple):
    """What an attempt used, measured by its trainer once, when its verdict is decided."""

    token: int
    """The token the attempt ran under: its time is booked only while the record names it."""
    busy_s: float
    """Seconds of the attempt, on its trainer's monotonic clock."""
    cost: float
    metered_s: float = 0.0
    """Trainer-seconds of it the run's credits pay for (`RunRecord.metered_s`)."""


def book_time(spent: Spent, **fields: object) -> Change:
    """While the run is not over and names `spent.token`: the attempt's time and cost added,
    and `fields` set (`worker=None` clears `group` too: nobody holds the run, so no group
    trains it)."""
    if fields.get("worker", "") is None:
        fields["group"] = []

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != spent.token:
            return None
        return _replace(
            r, busy_s=r.busy_s + spent.busy_s, actual_cost=r.actual_cost + spent.cost,
            metered_s=r.metered_s + spent.metered_s, **fields,
        )  # fmt: skip

    return change


def complete(spent: Spent, step: int, digest: str, metrics: dict[str, float]) -> Change:
    """As `book_time`: COMPLETED at the final checkpoint's `step`, `digest` and `metrics`;
    nobody holds it, no reason."""
    return book_time(
        spent, state=RunState.COMPLETED, step=step, digest=digest, metrics=metrics,
        worker=None, reason=None,
    )  # fmt: skip


def cancel_attempt(spent: Spent, reason: str, step: int | None = None) -> Change:
    """As `book_time`: CANCELLED (the attempt checkpointed and stopped when asked), nobody
    holds it; `step` when the attempt's last checkpoint is known committed."""
    kept = {} if step is None else {"step": step}
    return book_time(spent, state=RunState.CANCELLED, reason=reason, worker=None, **kept)


def pause_attempt(spent: Spent, reason: str, step: int | None = None) -> Change:
    """As `book_time`: PAUSED for `reason` (asked to pause, or the job's policy held it
    for a human), nobody holds it; `step` as for `cancel_attempt`."""
    kept = {} if step is None else {"step": step}
    return book_time(
        spent, state=RunState.PAUSED, pause_requested=reason, worker=None, **kept
    )  # fmt: skip


def roll_back(spent: Spent, skip: Skip) -> Change:
    """As `book_time`: nobody holds the run, which stays RUNNING for the next attempt, and
    that attempt leaves out the data `skip` says (the divergence guard's rollback)."""

    def change(r: RunRecord) -> RunRecord | None:
        booked = book_time(spent, worker=None)(r)
        return None if booked is None else _replace(booked, skips=[*booked.skips, skip])

    return change


def release(spent: Spent, step: int | None = None) -> Change:
    """As `book_time`: nobody holds the run (preempted, or its group lost a rank), which
    stays RUNNING for the next attempt; `step` as for `cancel_attempt`."""
    kept = {} if step is None else {"step": step}
    return book_time(spent, worker=None, **kept)


def lose_rank(spent: Spent, kept: int) -> Change:
    """As `release`, the group to form again: a rank lost, uncounted; the newest committed
    checkpoint's step `kept` is noted (`broke_at`), so that a break again before any
    checkpoint past it counts (`count_failure`)."""
    return book_time(spent, worker=None, broke_at=kept)


def requeue(spent: Spent, step: int | None = None) -> Change:
    """As `book_time`: the attempt made room for another run (the scheduler's `preempt`),
    so the run is QUEUED again at the next dispatch, waiting for the scheduler (not
    admitted), held by nobody; `step` as for `cancel_attempt`."""
    kept = {} if step is None else {"step": step}
    booked = book_time(spent, worker=None, **kept)

    def change(r: RunRecord) -> RunRecord | None:
        new = booked(r)
        return None if new is None else _requeued(new)

    return change


def requeue_unowned(r: RunRecord) -> RunRecord | None:
    """While the run is RUNNING and asked to make room (its trainer gone before it could,
    a new one took the task): QUEUED again, as `requeue`."""
    if r.state is not RunState.RUNNING or r.preempt is None or r.preempt.to_ranks:
        return None
    return _requeued(r)


def _requeued(r: RunRecord) -> RunRecord:
    return _replace(
        r, state=RunState.QUEUED, admitted=False, preempt=None, ranks_cap=None, worker=None,
        group=[], delivery=None, dispatch=r.dispatch + 1, preemptions=r.preemptions + 1,
    )  # fmt: skip


def count_failure(
    holding: Callable[[], int], spent: Spent, reason: str, *, fatal: bool,
    stall: Stall | None = None,
) -> Change:  # fmt: skip
    """While the run is not over and names `holding()` (the attempt's token as the change
    applies): the time booked (`book_time`, a no-op unless `spent.token` is still named),
    one more retry, the reaper's stop order and the holder cleared; FAILED for `reason`
    when `fatal` or the retries are used up. An attempt stopped for a `stall` records it;
    one that hung after the same step as the last stalled attempt is not retried: FAILED,
    or PAUSED where the job pauses on a failure."""
    booked = book_time(spent)

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != holding():
            return None
        r = booked(r) or r
        retries = r.retries + 1
        again = stall is not None and r.stall is not None and r.stall.step == stall.step
        said = f"{reason}, as the attempt before did: a hang that repeats is not retried"
        told = said if again else reason
        give_up = fatal or again or retries > r.spec.limits.max_retries
        hold = not fatal and r.on_failure == "pause"
        if hold:
            state, why = RunState.PAUSED, f"held for a human after: {told}"
        elif give_up or r.on_failure == "fail_fast":
            state, why = RunState.FAILED, told
        else:
            state, why = r.state, None
        return _replace(
            r, retries=retries, stop_token=None, stop_reason=None, worker=None, group=[],
            state=state, reason=why if state is RunState.FAILED else r.reason,
            pause_requested=why if hold else r.pause_requested, stall=stall or r.stall,
        )  # fmt: skip

    return change


def note_changed(token: int, changed: list[str]) -> Change:
    """While the attempt of `token` holds the run: what differed from the software its
    checkpoint recorded as it resumed (`RunRecord.changed`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != token or r.changed == changed:
            return None
        return _replace(r, changed=changed)

    return change


def ask_checkpoint(r: RunRecord) -> RunRecord | None:
    """While the run is RUNNING: one more checkpoint asked of the attempt holding it."""
    if r.state is not RunState.RUNNING:
        return None
    return _replace(r, checkpoints_asked=r.checkpoints_asked + 1)


def cancel_unowned(r: RunRecord) -> RunRecord | None:
    """While the run is RUNNING and asked to cancel (its trainer gone, a new one took the
    task): CANCELLED for the reason asked."""
    if r.state is not RunState.RUNNING or r.cancel_requested is None:
        return None
    return _replace(r, state=RunState.CANCELLED, reason=r.cancel_requested)


def pause_unowned(r: RunRecord) -> RunRecord | None:
    """While the run is RUNNING and asked to pause (its trainer gone, a new one took the
    task, or the reaper found it lost): PAUSED for the reason asked."""
    if r.state is not RunState.RUNNING or r.pause_requested is None:
        return None
    return _replace(r, state=RunState.PAUSED, worker=None, group=[])


def unchanged(r: RunRecord) -> RunRecord | None:
    """Never applies: a verdict that writes nothing, only asks how the run stands."""
    return None


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
    """A QUEUED or PAUSED run the hub holds: CANCELLED for `reason`. A RUNNING one, or one
    granted to a site, not asked yet: asked to cancel (`cancel_requested`; its trainer
    checkpoints and stops, or the site cancels it when it takes it). Otherwise None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state in (RunState.QUEUED, RunState.PAUSED) and not r.site:
            return _replace(r, state=RunState.CANCELLED, reason=reason)
        if (r.state is RunState.RUNNING or r.site) and r.cancel_requested is None:
            # Granted to a site, the run is the site's to end: asked, like a running one.
            return None if r.state.terminal else _replace(r, cancel_requested=reason)
        return None

    return change


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


def resume(hold: tuple[int, int] | None = None, *, allow_changes: bool = False) -> Change:
    """A PAUSED run: QUEUED at the next dispatch, waiting for the scheduler to admit it, no
    longer asked to pause, its failures forgiven (a human looked); with `hold`, its hold
    number `hold[0]` of `hold[1]` units added (taken in the ledger first); with
    `allow_changes`, allowed to resume under other software (`changes_allowed`). Otherwise
    None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.PAUSED:
            return None
        if hold is not None:
            added = add_hold(*hold)(r)
            if added is None:
                return None
            r = added
        return _replace(
            r, state=RunState.QUEUED, dispatch=r.dispatch + 1, pause_requested=None, retries=0,
            worker=None, group=[], admitted=False, preempt=None, ranks_cap=None,
            changes_allowed=r.changes_allowed or allow_changes,
        )  # fmt: skip

    return change


def add_hold(n: int, amount: int) -> Change:
    """While the run is not over and holds `n` holds: the `n`-th, of `amount` units,
    added (its ledger entry is written first, once: `shared.ledger`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or len(r.holds) != n:
            return None
        return _replace(r, holds=[*r.holds, amount])

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


def order_rollback(step: int, reason: str) -> Change:
    """A QUEUED, RUNNING or PAUSED run: ordered back to its committed checkpoint at `step`
    (`rollback_to`: the attempt running stops without a checkpoint, and the next one rewinds
    `latest` before it starts). A FAILED run whose failure was announced: reopened — QUEUED
    at the next dispatch, for the scheduler to admit, its failures forgiven — and ordered
    the same way. A COMPLETED or CANCELLED run, or a FAILED one whose failure is
    still being announced: None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is RunState.FAILED and not r.announce_pending:
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


# -- grants to sites (`shared.state.grants`) --------------------------------------------


def grantable(r: RunRecord) -> bool:
    """A QUEUED run of a fixed size (one rank or a group; an elastic group stays the hub's)
    that the hub holds, waiting for the scheduler, asked nothing: one `delegate` applies to."""
    asked = r.cancel_requested or r.pause_requested or r.rollback_to is not None
    return (
        r.state is RunState.QUEUED and not r.site and not r.spec.elastic and not asked
        and not r.admitted
    )  # fmt: skip


def delegate(site: str) -> Change:
    """A `grantable` run: granted to `site` under the next epoch (the site starts it, also
    while cut off), which admits it."""

    def change(r: RunRecord) -> RunRecord | None:
        if not grantable(r):
            return None
        return _replace(
            r, site=site, epoch=r.epoch + 1, worker=None, delivery=None, group=[], admitted=True
        )

    return change


def take_back(site: str, epoch: int) -> Change:
    """While `site` holds the run under `epoch` and it is not over: the hub's again under
    the next epoch (every token of the site's grant is then below the hub's), QUEUED at the
    next dispatch for the scheduler to admit (a PAUSED run stays paused), held by nobody."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.site != site or r.epoch != epoch:
            return None
        state = RunState.PAUSED if r.state is RunState.PAUSED else RunState.QUEUED
        return _replace(
            r, site="", epoch=epoch + 1, state=state, dispatch=r.dispatch + 1, worker=None,
            delivery=None, group=[], admitted=False,
        )  # fmt: skip

    return change


def reconcile(site: str, reported: RunRecord, owns: bool = False) -> Change:
    """The record `site` keeps of a run granted to it, taken in at the hub: while the hub's
    record still grants the run to `site` under the reported epoch and is not over, it
    becomes the site's, keeping what was asked at the hub meanwhile (cancel, pause,
    checkpoints). An ended record only has its announcement mark cleared, once the site's
    is. A run submitted at `site` whose job the hub also queued, and never started, becomes
    the site's (the same job submitted at both sides of a cut is one run); so does one the
    hub also started, or granted elsewhere, when the store's chain is the site's under the
    reported epoch (`owns`: `shared.state.owner.wins_report`) — the store decides, and the
    record follows it. None when there is nothing to take in (a report of a revoked grant,
    a side the store did not choose, or a repeat). The hub's copy's credits, if it held
    any, go with the run."""

    def change(r: RunRecord) -> RunRecord | None:
        if _submitted_at_both(r, site, reported) or _chosen_by_store(r, site, reported, owns):
            # The hub's copy held credits at submit: the run settles them when it ends.
            return _replace(reported, price=r.price, holds=r.holds) if r.holds else reported
        if r.site != site or r.epoch != reported.epoch:
            return None
        if r.state.terminal:
            done = r.announce_pending and not reported.announce_pending
            return _replace(r, announce_pending=False) if done else None
        new = _replace(
            reported,
            cancel_requested=reported.cancel_requested or r.cancel_requested,
            pause_requested=reported.pause_requested or r.pause_requested,
            checkpoints_asked=max(r.checkpoints_asked, reported.checkpoints_asked),
            dispatch=max(r.dispatch, reported.dispatch),
        )
        return None if _replace(new, updated_at=r.updated_at) == r else new

    return change


def _chosen_by_store(r: RunRecord, site: str, reported: RunRecord, owns: bool) -> bool:
    """The hub's record of a run it also ran (or granted elsewhere) gives way to `site`'s:
    the store's chain is the site's, under an epoch the hub's record has not reached."""
    return (
        owns and not r.state.terminal and (r.site, r.epoch) != (site, reported.epoch)
        and reported.epoch > r.epoch and r.spec_hash == reported.spec_hash
    )  # fmt: skip


def yield_to(token: int, site: str, epoch: int, side: str = "") -> Change:
    """The store's chain is `site`'s under `epoch` ("" the hub; `shared.state.owner`), not
    the run of the attempt holding `token` at `side`: while the run is not over and still
    names `token`. At the hub the record follows the store: a grant to `site` under
    `epoch`, held by nobody here, whose site's reports are then taken in (`reconcile`) and
    which is taken back if that site stays silent (`take_back`). At a site, the site's own
    record only lets the run go (nobody holds it, the reason says whose it is); the hub
    ignores it."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != token:
            return None
        whose = f"site {site}" if site else "the hub"
        if side:
            return _replace(r, worker=None, delivery=None, reason=f"trained by {whose}")
        state = RunState.PAUSED if r.state is RunState.PAUSED else RunState.RUNNING
        return _replace(
            r, site=site, epoch=epoch, state=state, worker=None, delivery=None, group=[],
            admitted=True, reason=f"trained by {whose}: its checkpoints are the run's",
        )  # fmt: skip

    return change


def past_store(token: int, epoch: int) -> Change:
    """The store holds a token of this side at or above `token`, which the hub issued
    and then forgot (the unsynced tail of its streams lost in a crash): while the run is
    not over and still names `token`, its epoch moves to `epoch`, so the next lease's
    token is above every one the store has seen (`shared.state.owner`); nobody holds it."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != token:
            return None
        return _replace(r, epoch=max(r.epoch, epoch), worker=None, delivery=None)

    return change


def _submitted_at_both(r: RunRecord, site: str, reported: RunRecord) -> bool:
    return (
        not r.site and r.state is RunState.QUEUED and r.attempts == 0 and reported.site == site
        and reported.epoch > r.epoch and r.spec_hash == reported.spec_hash
    )  # fmt: skip


def accept_grant(granted: RunRecord) -> Change:
    """At the site, whose bucket keeps a record of the run already: the record the hub
    granted, if its epoch is newer (a grant the site has not seen yet)."""

    def change(r: RunRecord) -> RunRecord | None:
        return granted if granted.epoch > r.epoch else None

    return change


def forward_requests(hub: RunRecord) -> Change:
    """At the site: what was asked of the run at the hub (cancel, pause, checkpoints) while
    the hub still grants it under the site's epoch, unless the run is over or was asked
    already; and the end the hub decided (a hard timeout), which its trainer then obeys as
    any run's (`Order.OVER`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or hub.epoch != r.epoch or hub.site != r.site:
            return None
        if hub.state.terminal:
            return _replace(r, state=hub.state, reason=hub.reason)
        cancel = r.cancel_requested or hub.cancel_requested
        pause = r.pause_requested or hub.pause_requested
        asked = max(r.checkpoints_asked, hub.checkpoints_asked)
        if (cancel, pause, asked) == (r.cancel_requested, r.pause_requested, r.checkpoints_asked):
            return None
        return _replace(
            r, cancel_requested=cancel, pause_requested=pause, checkpoints_asked=asked
        )

    return change


# -- the scheduler (`shared.scheduling`, `services/dispatcher/scheduler.py`) ---------------


def admit(dispatch: int, cap: int | None) -> Change:
    """While the run is QUEUED at dispatch `dispatch`, the hub's, waiting for the scheduler
    and asked nothing: admitted (its writer then publishes its task), an elastic run
    allowed `cap` ranks."""

    def change(r: RunRecord) -> RunRecord | None:
        asked = r.cancel_requested or r.pause_requested
        if r.state is not RunState.QUEUED or r.admitted or r.site or asked:
            return None
        if r.dispatch != dispatch:
            return None
        return _replace(r, admitted=True, ranks_cap=cap, waiting=None)

    return change


def queued_because(why: str) -> Change:
    """While the run is QUEUED waiting for the scheduler and `waiting` says otherwise: it
    says `why` (`baton status`; `baton queue` has the numbers)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.QUEUED or r.admitted or r.waiting == why:
            return None
        return _replace(r, waiting=why)

    return change


def ask_preempt(token: int | None, order: Preemption) -> Change:
    """While the run is RUNNING under `token` (as the scheduler saw it), at the hub, asked
    nothing else: asked to make room (`RunRecord.preempt`; a shrink also caps its ranks)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is not RunState.RUNNING or r.token != token or r.site:
            return None
        if r.preempt is not None or r.cancel_requested or r.pause_requested:
            return None
        cap = order.to_ranks or r.ranks_cap
        return _replace(r, preempt=order, ranks_cap=cap)

    return change


def cap_ranks(cap: int) -> Change:
    """While the elastic run is not over nor asked to make room: it may hold `cap` ranks."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.preempt is not None or r.ranks_cap == cap:
            return None
        return _replace(r, ranks_cap=cap)

    return change


def settled(r: RunRecord) -> RunRecord | None:
    """A terminal record whose holds are settled in the ledger: marked so, once."""
    if not r.state.terminal or r.settled:
        return None
    return _replace(r, settled=True)
