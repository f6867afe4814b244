"""The reaper's times, each a difference of two readings of one clock.

Invariant: no decision of the reaper compares a time another host wrote with the reaper's
own clock. What it decides on:

* durations it observes itself (a step that stopped moving, a run without lease or task, a
  record still pending): its monotonic clock, in `service.py`;
* how long ago a run was accepted (its timeouts) and how long ago a record was last
  written (retiring it): the hub server's clock — its stamp on the run's first `accepted`
  event and on the record's revision, against its time now (`shared.state.clock`);
* how long it has seen a checkpoint object (garbage): its monotonic clock
  (`shared.checkpoint.retention.Sightings`).

A timeout's length is `deadline_at − created_at`: two times the dispatcher wrote in one go,
so their difference is its own, whatever its clock says.
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.contracts import RunRecord
from shared.state.clock import server_now, stamp

log = logging.getLogger("baton.reaper")


class HubClock:
    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._now: float | None = None
        self._accepted: dict[str, float] = {}

    def tick(self) -> None:
        """A new sweep: the next `now` asks the server again."""
        self._now = None

    async def now(self) -> float:
        """The hub server's clock, read once per sweep (one stream info request)."""
        if self._now is None:
            self._now = await server_now(self.nc, f"KV_{names.RUNS_BUCKET}")
        return self._now

    async def accepted_at(self, run_id: str) -> float | None:
        """The server's stamp of the run's first `accepted` event (a duplicate submission
        emits another later, which must not move it): read once per run, then kept."""
        if run_id in self._accepted:
            return self._accepted[run_id]
        try:
            msg = await self.js.get_msg(
                names.EVENTS_STREAM, seq=1, subject=names.event_subject(run_id, "accepted"),
                next=True,
            )  # fmt: skip
        except NotFoundError:
            return None  # not stored yet, or aged out of the stream
        self._accepted[run_id] = stamp(msg.time)
        return self._accepted[run_id]

    async def running_for(self, r: RunRecord) -> float:
        """Seconds since the run was accepted, on the hub server's clock. A run whose
        `accepted` event is not (or no longer) stored falls back to its `created_at` on the
        reaper's clock: the dispatcher's and the reaper's, two hub services (the only such
        comparison left, and only for such a run)."""
        accepted = await self.accepted_at(r.run_id)
        if accepted is None:
            log.debug("%s: no accepted event; timing it from created_at", r.run_id)
            return time.time() - r.created_at
        return await self.now() - accepted

    def forget(self, alive: set[str]) -> None:
        for run_id in [k for k in self._accepted if k not in alive]:
            del self._accepted[run_id]
