"""Leases that lapse: a run whose trainer went silent for a whole TTL is handed over then.

The leases bucket leaves a marker when a lease expires on the server's clock (its
`limit_marker_ttl`, `shared.bus.streams`). The reaper watches the bucket for those markers
and hands the run over (`shared.state.handover`): the task is delivered again when the lease
expires, not when its AckWait runs out (1.5 × the TTL after the holder's last
`in_progress`). This is the death nobody witnessed — a host gone, a partition, a trainer
stopped past its TTL — so only the lease's expiry may decide it: a trainer that comes back
within the TTL keeps its run.

The watch costs nothing while leases are renewed: the consumer delivers headers only, and
the reaper reads a run's record only when its lease expired. A marker the reaper misses (it
was down or cut off in the second the marker lives) costs what every lapse cost before: the
task's AckWait.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from shared.bus import names
from shared.contracts import RunState
from shared.state.handover import hand_over
from shared.state.lease import holder, lease_key, run_of_key
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")

MARKER_REASON = "Nats-Marker-Reason"
EXPIRED = "MaxAge"
"""The reason the server gives a marker it left for a message that expired (its TTL)."""


class Lapses:
    def __init__(self, nc: Client, js: JetStreamContext, runs: Runs, secret: bytes | None) -> None:
        self.nc = nc
        self.js = js
        self.runs = runs
        self.secret = secret
        self._prefix = f"$KV.{names.LEASES_BUCKET}."
        self._sub: Subscription | None = None

    async def start(self) -> None:
        # Ordered: it follows the stream from now on, and recreates itself after a reconnect.
        self._sub = await self.js.subscribe(
            f"{self._prefix}>",
            stream=f"KV_{names.LEASES_BUCKET}",  # named: a lookup by subject needs more rights
            cb=self._on_entry,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
            headers_only=True,
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_entry(self, msg: Msg) -> None:
        if (msg.headers or {}).get(MARKER_REASON) != EXPIRED:
            return  # a lease taken, renewed or released
        run_id = run_of_key(msg.subject.removeprefix(self._prefix), self.secret)
        if run_id is None:
            return
        try:
            await self.lapsed(run_id)
        except Exception:  # the hub busy or restarting: the task's AckWait still stands
            log.exception("%s: could not hand the run over after its lease expired", run_id)

    async def lapsed(self, run_id: str) -> bool:
        """The lease of `run_id` expired: hand its run over if it is still running under the
        attempt that let it lapse. True if this call handed it over."""
        found = await self.runs.get(run_id)
        if found is None:
            return False
        r = found[0]
        if r.state is not RunState.RUNNING or r.token is None or r.worker is None:
            return False
        if await holder(self.js, lease_key(run_id, self.secret)) is not None:
            return False  # taken again since: its new holder is alive
        reason = f"its lease expired: {r.worker} was silent for a whole lease TTL"
        return await hand_over(self.nc, self.js, self.runs, run_id, r.token, reason)
