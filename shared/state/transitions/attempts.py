"""How an attempt moves its run's record: starting and holding it (its token, its step,
what it waits for), and the verdict it ends in — booked with the time it spent."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from shared.contracts import RunRecord, RunState, Skip
from shared.contracts.records import Stall
from shared.state.runs import Change

_replace = msgspec.structs.replace


# -- starting and holding an attempt ----------------------------------------------------


def mark_running(
    worker: str, token: int, delivery: str | None, group: list[str], site: str = ""
) -> Change:
    """Unless the run is over, a newer token holds it, it is granted elsewhere than to
    `site` ("" = the hub) or it waits for the scheduler (not admitted): RUNNING under
    `worker` and `token`, one more attempt, answering `delivery`, trained by `group` (its
    workers by rank, [] for one rank), no longer waiting nor asked to make room. An
    attempt before it that ended without a verdict is booked the seconds it committed
    (`RunRecord.committed_s`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.state is RunState.PAUSED or (r.token or 0) > token:
            return None
        if r.site != site or (r.state is RunState.QUEUED and not r.admitted):
            return None
        if r.token != token:
            r = book_committed(r)
        # A shrink is done once the smaller group trains; a whole preemption never gets here.
        return _replace(
            r, state=RunState.RUNNING, worker=worker, token=token, attempts=r.attempts + 1,
            delivery=delivery, waiting=None, group=group, group_size=len(group) or 1,
            preempt=None,
        )  # fmt: skip

    return change


def book_committed(r: RunRecord) -> RunRecord:
    """`r` with the seconds its last attempt committed (`committed_s`) in `metered_s`."""
    if not r.committed_s:
        return r
    return _replace(r, metered_s=r.metered_s + r.committed_s, committed_s=0.0)


def advance_step(token: int, step: int, trained_s: float = 0.0) -> Change:
    """While the run is not over, names `token` and is behind `step`: its newest committed
    checkpoint is at `step`, which the attempt reached after training `trained_s`
    trainer-seconds (`RunRecord.committed_s`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.token != token or r.step >= step or r.state.terminal:
            return None
        return _replace(r, step=step, committed_s=max(r.committed_s, trained_s))

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
    """While the run is not over and names `spent.token`: the attempt's time and cost added
    (the whole attempt's metered seconds, its commits' included), and `fields` set
    (`worker=None` clears `group` too: nobody holds the run, so no group trains it)."""
    if fields.get("worker", "") is None:
        fields["group"] = []

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or r.token != spent.token:
            return None
        return _replace(
            r, busy_s=r.busy_s + spent.busy_s, actual_cost=r.actual_cost + spent.cost,
            metered_s=r.metered_s + spent.metered_s, committed_s=0.0, **fields,
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
