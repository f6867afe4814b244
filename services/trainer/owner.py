"""An attempt asks the store whose run it is (`shared.state.owner`) before it trains, and
again when the store refuses its commit; here is what it does with each answer.

    decision    before training                      after a refused commit (at the hub)
    TRAIN       trains                               fenced, as before
    COMPLETE    COMPLETED from the final checkpoint  —
                the store holds: nothing trained
    YIELD       YIELDED: the record follows the      YIELDED, with the steps it trained
                store, `superseded` says so (at a     reported as wasted (at a site, only
                site, only for a final chain: a run   for a final chain)
                taken back is fenced, as before)
    ENDED       at a site, YIELDED (the run was      likewise (at the hub: fenced)
                cancelled at the hub); at the hub,
                CANCELLED (it was, and the hub
                forgot)
    FORGOTTEN   the record's epoch moves past the    —
                store's, the task goes back now (at
                the hub; a site trains as before)

"At a site" is an attempt of a run granted to a site (`Attempt.side`); a hub task that a
site's trainer took is the hub's, and its commits extend the hub's chain.

Without this, an attempt whose tokens the store refuses (another side's chain is ahead, or
the run is over) was fenced, its task delivered again after AckWait, and the next attempt
restored the other side's checkpoint and was refused again — up to the task's deliveries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.trainer.verdicts import Outcome, Verdict
from shared.checkpoint import commit
from shared.contracts import Pointer, RunRecord
from shared.contracts.events import Event, Superseded
from shared.state import owner, transitions
from shared.state.owner import Decision

if TYPE_CHECKING:
    from services.trainer.course import AttemptView

log = logging.getLogger("baton.trainer")


async def before_training(a: AttemptView, latest: Pointer | None) -> Verdict | None:
    """The verdict when the store says this attempt must not train; None when it may."""
    said = owner.decide(a.side, a.token, latest)
    if said.decision is Decision.TRAIN or latest is None:
        return None
    if said.decision is Decision.COMPLETE:
        manifest = await commit.load_manifest(a.store, latest.manifest)
        log.warning("%s: its final checkpoint (step %d) is committed already; completed from "
                    "the store, nothing trained", a.run_id, manifest.step)  # fmt: skip
        done = transitions.complete(a.spent(), manifest.step, manifest.digest, manifest.metrics)
        return Verdict(Outcome.COMPLETED, change=done)
    if said.decision is Decision.ENDED:
        log.warning("%s: the run was %s (the store is sealed): nothing trained", a.run_id,
                    latest.ended)  # fmt: skip
        if not a.side:
            # The hub ended it and then forgot (the unsynced tail of its streams lost):
            # the record follows the store, and the end is told again.
            why = f"{latest.ended}: its checkpoint chain is sealed"
            return Verdict(Outcome.CANCELLED, change=transitions.cancel_attempt(a.spent(), why))
        return yielded(a, said.site, said.epoch, wasted=0)
    if said.decision is Decision.YIELD:
        if a.side and not latest.final:
            return None  # taken back: its keeper and its commits fence it, as before
        return yielded(a, said.site, said.epoch, wasted=0)
    if a.side:  # a site cannot move an epoch the hub counts: its commits tell
        log.warning("%s: the store holds token %d of this site, at or above ours (%d)",
                    a.run_id, latest.token, a.token)  # fmt: skip
        return None
    log.warning("%s: the store holds token %d, at or above the lease's %d: the hub forgot its "
                "newest writes; the run moves to epoch %d", a.run_id, latest.token, a.token,
                said.epoch)  # fmt: skip
    return Verdict(Outcome.PREEMPTED, change=transitions.past_store(a.token, said.epoch))


async def after_refusal(a: AttemptView) -> Verdict | None:
    """Once the store refused this attempt's commit: YIELDED if another side's chain is the
    run's (at a site, only one that is final or sealed: a grant taken back is fenced, as
    before), None to be fenced as before."""
    found = await commit.read_latest(a.store, a.run_id)
    latest = found[0] if found else None
    if a.side and not (latest is not None and (latest.final or latest.ended)):
        return None
    said = owner.decide(a.side, a.token, latest)
    if said.decision is Decision.ENDED and not a.side:
        return None  # the record ended at the hub already: fenced as before
    if said.decision not in (Decision.YIELD, Decision.ENDED):
        return None
    a.child.kill()
    return yielded(a, said.site, said.epoch, wasted=max(0, a.step - a.start_step))


def yielded(a: AttemptView, site: str, epoch: int, wasted: int) -> Verdict:
    whose = f"site {site}" if site else "the hub"
    log.warning("%s: the store's chain is %s's (epoch %d); this attempt stops, %d step(s) "
                "trained in vain", a.run_id, whose, epoch, wasted)  # fmt: skip

    def superseded(r: RunRecord) -> Event:
        return Superseded(
            run_id=a.run_id, owner=site, epoch=epoch, loser=a.side, loser_token=a.token,
            wasted_steps=wasted,
        )  # fmt: skip

    change = transitions.yield_to(a.token, site, epoch, side=a.side)
    return Verdict(Outcome.YIELDED, change=change, event=superseded)
