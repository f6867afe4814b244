"""A site trainer's runs granted by the hub: taken, leased and ended at the site.

The hub grants queued runs to a site ahead of need (`services/dispatcher/delegation.py`);
their tasks wait in the site's own work queue, and the site keeps their records and leases
in its own domain (`shared.state.grants`). So a site trainer starts, leases, checkpoints
and completes a granted run with the hub out of reach: every record change goes to the
site's runs bucket (the same transitions as at the hub), every event to the site's outbox,
every commit to the site's checkpointer. The hub sources the site's runs bucket and takes
the records in once (`services/reaper/grants.py`).

The first trainer to take a granted task seeds the site's record from the grant it carries
(`Runs.adopt`, or `transitions.accept_grant` for a newer grant of a run the site held
before). A copy of an older grant is dropped. While the link is up, the attempt asks the
hub every few seconds whether the grant still holds (`GrantCheck`): a run the hub took
back is fenced at once (the store refuses its commits already), and what was asked at the
hub meanwhile — a cancel, a pause — is copied into the site's record, where the lease
keeper reads its orders as at the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from services.trainer.verdicts import Scope
from shared.bus import names
from shared.bus.answer import dead_letter
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, Task, decode
from shared.errors import ContractError
from shared.state import transitions
from shared.state.grants import epoch_of
from shared.state.lease import Lease
from shared.state.runs import Runs
from shared.waits import wait_set

log = logging.getLogger("baton.trainer")

HUB_READ_S = 3.0
"""How long a look at the hub's record may take before the grant is taken to hold (a cut)."""

Start = Callable[[Task, Lease, Msg, Scope, RunRecord], Awaitable[None]]
Handle = Callable[[Msg], Awaitable[None]]
HUB_RETRY_S = 5.0
"""How long the hub's queue is left alone after a fetch from it failed (a cut)."""


class Granted:
    def __init__(
        self, js: JetStreamContext, hub: JetStreamContext, settings: Settings, store: Store
    ) -> None:
        self.js = js
        """The site's own domain: its work queue, runs and leases buckets."""
        self.hub = hub
        self.settings = settings
        self.site = settings.site
        self.store = store
        self.runs: Runs
        self.hub_runs: Runs | None = None

    async def open(self) -> None:
        """The site's queue and buckets, which the site's checkpointer declares."""
        consumer = trainer_consumer(
            self.settings.pool, self.settings.ack_wait_s, self.settings.max_deliver, self.site
        )
        await ensure_consumer(self.js, names.TASKS_STREAM, consumer)
        self.runs = await Runs.open(self.js, bucket=names.site_runs_bucket(self.site))

    async def serve(
        self, leave: asyncio.Event, hub: JetStreamContext, hub_reached: Callable[[], bool],
        on_granted: Handle, on_hub_task: Handle,
    ) -> None:  # fmt: skip
        """The site trainer's loop, one message at a time until `leave`: the runs granted
        to the site first, from its own queue, which a cut does not reach; then the hub's
        queue (runs of several ranks, calls for ranks, work not granted) once the hub was
        reached, left alone for a while after a fetch the cut made fail."""
        pool = names.trainer_consumer(self.settings.pool)
        mine = await self.js.pull_subscribe_bind(pool, names.TASKS_STREAM)
        hubs = None
        hub_back = 0.0
        try:
            while not leave.is_set():
                if hubs is None and hub_reached():
                    hubs = await hub.pull_subscribe_bind(pool, names.TASKS_STREAM)
                try:
                    took = await _fetch_one(mine, 1.0)
                except Exception as exc:  # the site's own server restarting
                    log.warning("the site's work queue is out of reach (%s); retrying", exc)
                    await wait_set(leave, 1.0)
                    continue
                if took is not None:
                    await on_granted(took)
                    continue
                if hubs is None or time.monotonic() < hub_back:
                    continue
                try:
                    took = await _fetch_one(hubs, 0.5)
                except Exception as exc:
                    log.debug("the hub's work queue is out of reach (%s)", exc)
                    hub_back = time.monotonic() + HUB_RETRY_S
                    continue
                if took is not None:
                    await on_hub_task(took)
        finally:
            # A fetch's late answer (a 408 for a fetch that had given up already) waits in
            # a pull subscription nobody reads, and the connection's drain would wait on it
            # until its timeout: a stopping site trainer took 30 s more to exit.
            for sub in (mine, hubs):
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def on_task(self, msg: Msg, start: Start) -> None:
        """Take a granted task: seed or read the site's record, take the site's lease under
        the grant's epoch, and `start` the run as any other."""
        try:
            task = decode(msg.data, Task)
            grant = task.grant
            if grant is None or grant.site != self.site or grant.run_id != task.run_id:
                raise ContractError(f"not a grant of {task.run_id} to site {self.site}")
        except ContractError as exc:
            await dead_letter(self.js, msg, "trainer", str(exc), site=self.site)
            await msg.term()
            return
        if not await self.runs.adopt(grant):
            await self.runs.update(task.run_id, transitions.accept_grant(grant))
        found = await self.runs.get(task.run_id)
        if found is None or found[0].epoch != grant.epoch:
            log.info("%s: a copy of an older grant (epoch %d); dropped", task.run_id, grant.epoch)
            await msg.ack()
            return
        record = found[0]
        if record.state.terminal or record.state is RunState.PAUSED:
            await msg.ack()
            return
        revoked = await GrantCheck(self, record)()
        if revoked is not None:
            log.warning("%s: not started: %s", task.run_id, revoked)
            await msg.ack()
            return
        found = await self.runs.get(task.run_id)  # with what the hub asked copied in
        assert found is not None
        record = found[0]
        lease = Lease(
            self.js, task.run_id, self.settings.worker_id, self.settings.lease_ttl_s,
            bucket=names.site_leases_bucket(self.site), epoch=grant.epoch,
        )  # fmt: skip
        if not await lease.acquire():
            await msg.nak(delay=self.settings.lease_ttl_s / 3)
            return
        scope = Scope(self.js, self.runs, lease, msg, self.settings.worker_id, self.site)
        await start(task, lease, msg, scope, record)
        await self._dropped_if_revoked(msg, grant)

    async def _dropped_if_revoked(self, msg: Msg, grant: RunRecord) -> None:
        """A grant the store has moved past (the hub took the run back) can never train
        again: its task is ended, rather than delivered to the site's trainers in turn."""
        try:
            latest = await commit.read_latest(self.store, grant.run_id)
        except Exception:  # the store out of reach: the task's next delivery looks again
            return
        if latest is not None and (epoch_of(latest[0].token) > grant.epoch or latest[0].ended):
            log.info("%s: grant epoch %d was revoked; its task ended", grant.run_id, grant.epoch)
            with contextlib.suppress(Exception):  # answered already
                await msg.term()

    def check(self, record: RunRecord) -> GrantCheck:
        return GrantCheck(self, record)


class GrantCheck:
    """Whether the hub still grants the run to this site (called by the lease keeper): a
    reason if the hub took it back; None while it holds, or the hub is out of reach. Copies
    the hub's requests (cancel, pause, checkpoints) and an end it decided (a hard timeout)
    into the site's record on the way, where the keeper reads its orders."""

    def __init__(self, granted: Granted, record: RunRecord) -> None:
        self.granted = granted
        self.record = record

    async def __call__(self) -> str | None:
        g = self.granted
        try:
            async with asyncio.timeout(HUB_READ_S):
                if g.hub_runs is None:
                    g.hub_runs = await Runs.open(g.hub, g.settings.hub_api)
                found = await g.hub_runs.get(self.record.run_id)
        except Exception:  # cut off: the grant holds
            return None
        if found is None:
            return None  # the hub has not taken in a run submitted here yet
        hub = found[0]
        if hub.epoch < self.record.epoch:
            # The hub's record is older than the site's: a run submitted here whose job the
            # hub also queued (the same key at both sides of a cut), or which the hub forgot
            # with its unsynced tail. Not a take-back: the store decides between the two
            # sides (`shared.state.owner`), and the hub takes this site's record in when its
            # chain is the run's.
            return None
        if hub.site != g.site or hub.epoch != self.record.epoch:
            return (
                f"the hub took the run back from site {g.site} (grant epoch {self.record.epoch}"
                f" revoked; now epoch {hub.epoch}"
                + (f" at site {hub.site})" if hub.site else " at the hub)")
            )
        await g.runs.update(self.record.run_id, transitions.forward_requests(hub))
        return None


async def _fetch_one(sub: JetStreamContext.PullSubscription, timeout: float) -> Msg | None:
    """The next message of a pull consumer, or None when none came within `timeout`."""
    try:
        msgs = await sub.fetch(1, timeout=timeout)
    except (TimeoutError, NatsTimeoutError):
        return None
    return msgs[0] if msgs else None
