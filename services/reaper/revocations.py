"""Runs of a revoked machine: handed over the moment it is revoked, not after its lease.

`baton machines revoke` has the registrar mark the machine revoked in `baton_machines` and
close its connections (`services/registrar`); its trainers may still be training, cut off,
with their leases alive for up to a TTL. The reaper watches the bucket for revocations and,
for each run a trainer of that machine holds, frees the lease — only while it still names
that trainer — and hands the run over (`shared.state.handover`), so another trainer resumes
it now. The machine can no longer reach NATS; were it to, the new attempt's higher token
fences it in the store.

A revocation the reaper misses (it was down in that instant) costs what any silent
trainer costs: the lease's TTL (`lapses.py`).
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
from shared.contracts.machines import Machine
from shared.machines.registry import revoked_in
from shared.state.handover import hand_over
from shared.state.lease import free, lease_key
from shared.state.runs import Runs

log = logging.getLogger("baton.reaper")


class Revocations:
    def __init__(self, nc: Client, js: JetStreamContext, runs: Runs, secret: bytes | None) -> None:
        self.nc = nc
        self.js = js
        self.runs = runs
        self.secret = secret
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.js.subscribe(
            f"$KV.{names.MACHINES_BUCKET}.machine.*",
            stream=f"KV_{names.MACHINES_BUCKET}",
            cb=self._on_entry,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_entry(self, msg: Msg) -> None:
        machine = revoked_in(msg.data)
        if machine is None:
            return
        try:
            await self.revoked(machine)
        except Exception:  # the hub busy: its runs' leases still lapse after their TTL
            log.exception("%s: could not hand its runs over after its revocation", machine.id)

    async def revoked(self, machine: Machine) -> list[str]:
        """Hand over every run a trainer of `machine` holds; the runs handed over."""
        workers = set(machine.workers())
        handed = []
        for run_id, found in await self.runs.live():
            if found is None:
                continue
            r = found[0]
            if r.state is not RunState.RUNNING or r.worker not in workers or r.token is None:
                continue
            if r.site:  # granted to a site: the site's to hand over (services/registrar/site.py)
                continue
            await free(self.js, lease_key(run_id, self.secret), r.worker, r.token)
            reason = f"machine {machine.id} was revoked"
            if await hand_over(self.nc, self.js, self.runs, run_id, r.token, reason):
                handed.append(run_id)
                log.info("%s: handed over, its trainer's machine %s revoked", run_id, machine.id)
        return handed
