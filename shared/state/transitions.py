"""Every way a run's record may move: named, pure record changes for `Runs.update`.

A record changes only by compare-and-swap (`Runs.update`), through a `Change`: a function of
the newest record that returns the changed record, or None when the change no longer applies
(the run is over, someone newer holds it, someone else made the change first). Each function
here is one such change, or makes one from what its writer knows; none reads anything but
its arguments and the record, so a retried CAS applies it again to the newer record.

Two guards recur. *Not over*: a terminal record is never changed (apart from clearing its
announcement mark), so exactly one writer ends a run (`shared.state.endings`). *Still ours*:
an attempt's change applies only while the record names its token (to start or to wait: no
newer one), so a fenced attempt writes nothing.

    who            transitions
    dispatcher     cancel
    trainer        mark_running, advance_step, retoken, wait, note_waiting, complete,
                   cancel_attempt, release, count_failure, fail (entry point refused),
                   cancel_unowned, unchanged
    reaper         end, fail (deliveries used up), stop, warn, redispatch
    anyone         hand_over (a dead attempt's task), mark_ending and announced (endings)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from shared.contracts import RunRecord, RunState
from shared.state.runs import Change

__all__ = [
    "Change",
    "Spent",
    "advance_step",
    "announced",
    "book_time",
    "cancel",
    "cancel_attempt",
    "cancel_unowned",
    "complete",
    "count_failure",
    "end",
    "fail",
    "hand_over",
    "mark_ending",
    "mark_running",
    "note_waiting",
    "redispatch",
    "release",
    "retoken",
    "stop",
    "unchanged",
    "wait",
    "warn",
]

_replace = msgspec.structs.replace


# -- starting and holding an attempt ----------------------------------------------------


def mark_running(worker: str, token: int, delivery: str | None, group: list[str]) -> Change:
    """Unless the run is over or a newer token holds it: RUNNING under `worker` and `token`,
    one more attempt, answering `delivery`, trained by `group` (its workers by rank, [] for
    one rank), no longer waiting."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.token or 0) > token:
            return None
        return _replace(
            r, state=RunState.RUNNING, worker=worker, token=token, attempts=r.attempts + 1,
            delivery=delivery, waiting=None, group=group, group_size=len(group) or 1,
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
            r, busy_s=r.busy_s + spent.busy_s, actual_cost=r.actual_cost + spent.cost, **fields
        )

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


def release(spent: Spent, step: int | None = None) -> Change:
    """As `book_time`: nobody holds the run (preempted, or its group lost a rank), which
    stays RUNNING for the next attempt; `step` as for `cancel_attempt`."""
    kept = {} if step is None else {"step": step}
    return book_time(spent, worker=None, **kept)


def count_failure(holding: Callable[[], int], spent: Spent, reason: str, *, fatal: bool) -> Change:
    """While the run is not over and names `holding()` (the attempt's token as the change
    applies): the time booked (`book_time`, a no-op unless `spent.token` is still named),
    one more retry, the reaper's stop order and the holder cleared; FAILED for `reason`
    when `fatal` or the retries are used up."""
    booked = book_time(spent)

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != holding():
            return None
        r = booked(r) or r
        retries = r.retries + 1
        give_up = fatal or retries > r.spec.limits.max_retries
        return _replace(
            r, retries=retries, stop_token=None, stop_reason=None, worker=None, group=[],
            state=RunState.FAILED if give_up else r.state,
            reason=reason if give_up else r.reason,
        )  # fmt: skip

    return change


def cancel_unowned(r: RunRecord) -> RunRecord | None:
    """While the run is RUNNING and asked to cancel (its trainer gone, a new one took the
    task): CANCELLED for the reason asked."""
    if r.state is not RunState.RUNNING or r.cancel_requested is None:
        return None
    return _replace(r, state=RunState.CANCELLED, reason=r.cancel_requested)


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
    """A QUEUED run: CANCELLED for `reason`. A RUNNING one not asked yet: asked to cancel
    (`cancel_requested`; its trainer checkpoints and stops). Otherwise None."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is RunState.QUEUED:
            return _replace(r, state=RunState.CANCELLED, reason=reason)
        if r.state is RunState.RUNNING and r.cancel_requested is None:
            return _replace(r, cancel_requested=reason)
        return None

    return change


def stop(token: int | None, reason: str) -> Change:
    """While the run is RUNNING under `token`: the reaper orders that attempt to stop
    (`stop_token`, `stop_reason`; a stall, counted as a failed attempt)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state is RunState.RUNNING and r.token == token:
            return _replace(r, stop_token=r.token, stop_reason=reason)
        return None

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
