"""How the scheduler and the ledger move a run's record: admitted or queued with the reason,
asked to make room (preemption), its ranks capped, its credits settled."""

from __future__ import annotations

import msgspec

from shared.contracts import RunRecord, RunState
from shared.contracts.records import Preemption
from shared.state.runs import Change
from shared.state.transitions.lifecycle import pause

_replace = msgspec.structs.replace


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


def unheld(r: RunRecord) -> bool:
    """A priced, owned run that holds nothing (a site's submission, priced as the hub took
    it in), trains or waits to, and is asked nothing yet: what an overdraft pauses."""
    asked = r.cancel_requested or r.pause_requested
    live = r.state in (RunState.QUEUED, RunState.RUNNING)
    return live and bool(r.price) and bool(r.owner) and not r.holds and not asked


def pause_unheld(reason: str) -> Change:
    """While the run holds nothing (`unheld`): paused for `reason`, or asked to pause where
    it trains (`pause`; a site's run through its grant, `forward_requests`)."""

    def change(r: RunRecord) -> RunRecord | None:
        return pause(reason)(r) if unheld(r) else None

    return change


def settled(r: RunRecord) -> RunRecord | None:
    """A terminal record whose holds are settled in the ledger: marked so, once."""
    if not r.state.terminal or r.settled:
        return None
    return _replace(r, settled=True)
