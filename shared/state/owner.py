"""Whose run it is, as the checkpoint store says: the one answer to "may this attempt train?"
when the hub's records and the store disagree.

Invariant: the store is the truth, and the hub may forget. A run's chain in the store (its
`latest` pointer, written by one side's checkpointer under one epoch's token) outranks any
record: a run whose chain ends in a final commit is complete, whatever a record says; a
chain written under an epoch the record does not know was written by another side (a site
that accepted the same job while cut off) or by the hub itself before it lost the unsynced
tail of its streams — and a token is never issued at or below the store's.

An attempt that has just taken its lease (`token`, under the record's `epoch`, at `side`:
"" the hub, else a site's name) reads `latest` and asks `decide`:

    latest                                              decision     the attempt
    none, or below `token`                              TRAIN        trains
    final, written by this side                         COMPLETE     completes the record from
                                                                     the store, trains nothing
    written by another side, under an epoch above the   YIELD        the run is that side's:
    record's (final or not)                                          the record follows it
                                                                     (`transitions.yield_to`),
                                                                     nothing trained
    final, by another side under an epoch at or below   YIELD        likewise
    the record's
    this side's, at or above `token`                    FORGOTTEN    the hub lost its tail: the
                                                                     record's epoch moves past
                                                                     the store's
                                                                     (`transitions.past_store`)
                                                                     and the task goes back
    sealed: the run ended without a final checkpoint    ENDED        stops, nothing trained (a
    (`ended`, a cancel at the hub: `commit.seal`)                    site's attempt lets the
                                                                     run go, and says so)

The same question is asked when the store refuses an attempt's commit (`services/trainer`),
and by the hub's reconciler when a site reports a run the hub also ran
(`transitions.reconcile`), so one rule decides in every place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shared.contracts import Pointer
from shared.state.grants import epoch_of


class Decision(enum.Enum):
    TRAIN = "train"
    COMPLETE = "complete"
    YIELD = "yield"
    FORGOTTEN = "forgotten"
    ENDED = "ended"


@dataclass(frozen=True)
class Ownership:
    decision: Decision
    site: str = ""
    """The side the store names (YIELD, ENDED): "" the hub, else a site."""
    epoch: int = 0
    """YIELD: the epoch the winning side writes under; FORGOTTEN: the lowest epoch whose
    tokens are all above the store's."""


def decide(side: str, token: int, latest: Pointer | None) -> Ownership:
    """What an attempt at `side` holding `token` may do with a run whose `latest` is
    `latest` (the module's table)."""
    if latest is None:
        return Ownership(Decision.TRAIN)
    if latest.ended:
        return Ownership(Decision.ENDED, site=latest.site, epoch=latest.epoch)
    ours = latest.site == side
    if latest.final:
        if ours:
            return Ownership(Decision.COMPLETE)
        return Ownership(Decision.YIELD, site=latest.site, epoch=latest.epoch)
    if not ours and latest.epoch > epoch_of(token):
        return Ownership(Decision.YIELD, site=latest.site, epoch=latest.epoch)
    if ours and latest.token >= token:
        return Ownership(Decision.FORGOTTEN, epoch=latest.epoch + 1)
    return Ownership(Decision.TRAIN)


def wins_report(site: str, epoch: int, latest: Pointer | None) -> bool:
    """A site's report of a run under `epoch` is the run's truth at the hub: the store's
    chain was written by that site under that epoch (its newest commit is the site's)."""
    return latest is not None and latest.site == site and latest.epoch == epoch
