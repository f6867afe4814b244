"""Goodput, exported as runs end: each run the reaper saw running and now sees finished is
read back from its events once (`shared.history.goodput`) and added to the
`baton.run.seconds` counter (by category and pool) and the `baton.run.goodput` histogram;
each of its interruptions to `baton.run.recovery`, by cause (`shared.history.recovery`).

Only runs that end while this reaper watches are counted, so a restarted reaper never counts
a run twice; a run whose terminal event has not arrived yet (a site's, still in its outbox)
is tried again on later sweeps, for up to `GIVE_UP_S`.

The events are read on the hub server's clock (`shared.bus.history.run_events`) before
any time is subtracted: a trainer whose clock is minutes off
adds no phantom minutes to any category.
"""

from __future__ import annotations

import logging
import time

from nats.js import JetStreamContext

from shared import telemetry
from shared.bus.history import run_events
from shared.contracts import RunRecord
from shared.history.goodput import goodput
from shared.history.recovery import recoveries

log = logging.getLogger("baton.reaper")

GIVE_UP_S = 600.0


class Accounts:
    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._live: set[str] = set()
        self._ended: dict[str, tuple[str, float]] = {}  # run -> (pool, first seen ended)

    async def sweep(self, records: list[RunRecord]) -> list[str]:
        """Export the runs that ended since the last sweep; returns those exported."""
        now = time.monotonic()
        for r in records:
            if r.state.terminal and r.run_id in self._live:
                self._ended.setdefault(r.run_id, (r.spec.pool, now))
        self._live = {r.run_id for r in records if not r.state.terminal}
        done = []
        for run_id, (pool, since) in list(self._ended.items()):
            if await self._export(run_id, pool) or now - since > GIVE_UP_S:
                del self._ended[run_id]
                done.append(run_id)
        return done

    async def _export(self, run_id: str, pool: str) -> bool:
        events = await run_events(self.js, run_id)
        spent = goodput(events)
        if spent is None or not spent.finished:
            return False  # its terminal event is still on its way
        for category, seconds in spent.seconds().items():
            attrs = {telemetry.POOL: pool, telemetry.CATEGORY: category}
            telemetry.RUN_SECONDS.add(max(0.0, seconds), attrs)
        telemetry.RUN_GOODPUT.record(spent.goodput, {telemetry.POOL: pool})
        for r in recoveries(events):
            telemetry.RUN_RECOVERY.record(
                r.seconds, {telemetry.POOL: pool, telemetry.CAUSE: r.cause}
            )
        log.info("%s: goodput %.1f%% of %.1fs", run_id, 100 * spent.goodput, spent.wall_s)
        return True
