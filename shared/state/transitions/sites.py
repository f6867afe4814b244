"""How a run's record moves between the hub and the sites: granted (delegated), taken back,
reconciled with a site's report, yielded to the side the store's chain names, and a
site's own record of a run granted to it."""

from __future__ import annotations

import msgspec

from shared.contracts import RunRecord, RunState
from shared.state.runs import Change

_replace = msgspec.structs.replace


# -- grants to sites (`shared.state.grants`) --------------------------------------------


def grantable(r: RunRecord) -> bool:
    """A QUEUED run (one rank, a group, an elastic group) that the hub holds, waiting for
    the scheduler, asked nothing: one `delegate` applies to."""
    asked = r.cancel_requested or r.pause_requested or r.rollback_to is not None
    return r.state is RunState.QUEUED and not r.site and not asked and not r.admitted


def delegate(site: str) -> Change:
    """A `grantable` run: granted to `site` under the next epoch (the site starts it, also
    while cut off), which admits it. An elastic run may hold up to its `max` there: the
    hub's scheduler caps only the runs it holds (its group forms and grows with the
    site's trainers, `services/trainer/group.py`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if not grantable(r):
            return None
        return _replace(
            r, site=site, epoch=r.epoch + 1, worker=None, delivery=None, group=[], admitted=True,
            ranks_cap=None,
        )  # fmt: skip

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
            # The ledger is the hub's: what its copy holds stays with the run, whatever the
            # site's record (which holds nothing) says.
            price=r.price or reported.price,
            holds=r.holds or reported.holds,
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


def complete_from_store(
    site: str, epoch: int, step: int, digest: str, metrics: dict[str, float]
) -> Change:
    """The store's chain ends in a final commit (at `step`, `digest`, `metrics`) that the
    side the record names will never complete from (another side wrote it): while the run
    is not over and still granted to `site` under `epoch`, COMPLETED from the store, nobody
    holding it. A run whose chain ends in a final commit is complete, whatever the record
    said (`shared.state.owner`)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.site, r.epoch) != (site, epoch):
            return None
        return _replace(
            r, state=RunState.COMPLETED, step=step, digest=digest, metrics=metrics,
            worker=None, delivery=None, group=[],
            reason=None,
        )  # fmt: skip

    return change


def end_granted(site: str, epoch: int, state: RunState, reason: str) -> Change:
    """While the run is not over and still granted to `site` under `epoch`: `state`
    (terminal) for `reason`, nobody holding it — the store's chain says it ended
    (`complete_from_store` for a final one)."""

    def change(r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.site, r.epoch) != (site, epoch):
            return None
        return _replace(r, state=state, reason=reason, worker=None, delivery=None, group=[])

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
