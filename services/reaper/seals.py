"""Sealing the store's chain of a run cancelled at the hub (`shared.checkpoint.commit.seal`).

A cancel ends the run's record; the store has no word of it, and its chain stays open. A
site cut off from the hub that accepted the same job (the same key at both sides) goes on
training it, commits on the open chain under its own higher epoch, and completes it: one
run with two ends, CANCELLED at the hub, `completed` from the site's outbox (seen in the
fault campaign on the three-node hub). So each run the hub cancelled has its chain sealed —
by whoever ends it, before its record says so (the dispatcher for a run nothing trains, its
hub attempt for a running one), and here, once, on the sweep after its record ended,
for one whose canceller died in between: every commit after it is refused, whichever
side or token, and the site's attempt learns at its next look at the store that the run
is over, lets it go, and says so (`superseded`, `services.trainer.owner`).

A FAILED run is not sealed: a rollback may reopen it. A COMPLETED one is sealed already by
its final checkpoint. A run cancelled at a site is sealed by nobody (its site's reports
say so at heal; the same job at the hub is decided by the store as any).
"""

from __future__ import annotations

import logging

from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.contracts import RunRecord, RunState

log = logging.getLogger("baton.reaper")


class Seals:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._sealed: set[str] = set()
        """Runs sealed by this reaper (a restarted one seals again: `seal` is idempotent)."""

    async def sweep(self, records: list[RunRecord]) -> list[str]:
        """Seal every run the hub cancelled that is not sealed yet; the runs sealed."""
        done = []
        live = {r.run_id for r in records}
        self._sealed &= live
        for r in records:
            if r.state is not RunState.CANCELLED or r.site or r.run_id in self._sealed:
                continue
            if await commit.seal(self.store, r.run_id, "cancelled"):
                log.info("%s: cancelled; its checkpoint chain is sealed", r.run_id)
                done.append(r.run_id)
            self._sealed.add(r.run_id)
        return done
