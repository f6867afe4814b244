"""How a trainer takes a task: the run's record read, its lease taken, then refused, ended as
asked, or trained — alone (`Attempt`) or as the leader of its group (`Leader`) — and a
group's call for a rank held (`Member`). `Taking` is the trainer's half that does it; the
trainer (`service.Trainer`) is the rest: its start, its loop, what runs beside it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from services.trainer.attempt import Attempt
from services.trainer.child_proc import Zygote
from services.trainer.claim import WorkDir
from services.trainer.drain import Draining
from services.trainer.forming import GaveWay, Superseded
from services.trainer.granted import Granted
from services.trainer.group import Leader
from services.trainer.presence import Presence
from services.trainer.rank import Member
from services.trainer.verdicts import Outcome, Scope, Verdict, apply
from shared import telemetry
from shared.bus import names
from shared.bus.answer import dead_letter
from shared.bus.service import StopSignals
from shared.checkpoint.store import Store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, Task, decode
from shared.contracts.groups import RankCall
from shared.contracts.tasks import Claim
from shared.errors import ContractError
from shared.state import transitions
from shared.state.groups import GroupStore
from shared.state.lease import Lease
from shared.state.policy import Policy
from shared.state.pools import Pools
from shared.state.runs import Runs

log = logging.getLogger("baton.trainer")

ATTEMPT_ERROR_DELAY_S = 5.0
STALE_RECORD_S = 1.0
HUB_FAULTS = (NatsError, TimeoutError, ConnectionError)
"""What the hub's servers answer (or fail to) while one is lost or a stream elects a leader."""
GIVE_BACK_S = 1.0
"""How long a task the hub would not let this trainer take stays off the queue."""


class Taking:
    """The task path of a trainer (`service.Trainer`), which holds all of these."""

    nc: Client
    js: JetStreamContext
    hub: JetStreamContext
    settings: Settings
    site: str
    signals: StopSignals
    store: Store
    runs: Runs
    policy: Policy
    pools: Pools
    beat_now: asyncio.Event
    draining: Draining
    attempt: Attempt | Member | None
    presence: Presence
    groups: GroupStore
    site_groups: GroupStore | None
    zygote: Zygote
    workdir: WorkDir
    granted: Granted | None

    async def on_task(self, msg: Msg) -> None:
        if self.draining.drained:
            # Fetched as the drain came: another trainer of the pool takes it at once.
            await msg.nak()
            return
        if msg.subject.startswith(f"{names.PREFIX}.calls."):
            await self.on_call(msg)
            return
        if msg.metadata.num_delivered > 1:
            telemetry.REDELIVERIES.add(1, {telemetry.POOL: self.settings.pool})
        try:
            task = decode(msg.data, Task)
        except ContractError as exc:
            await dead_letter(self.js, msg, "trainer", str(exc), site=self.site)
            await msg.term()
            return
        try:
            found = await self.runs.confirmed(task.run_id)
        except HUB_FAULTS as exc:
            await self._give_back(task, msg, exc)
            return
        if found is None:
            reason = f"no run record for {task.run_id}"
            await dead_letter(self.js, msg, "trainer", reason, site=self.site)
            await msg.term()
            return
        record = found[0]
        if await self._not_to_run(task, msg, record):
            return
        await self.zygote.warm()  # restarted if it died: before the lease, not after
        lease = Lease(
            self.hub, task.run_id, self.settings.worker_id, self.settings.lease_ttl_s,
            api_prefix=self.settings.hub_api, key=task.lease_key, epoch=record.epoch,
        )  # fmt: skip
        try:
            acquired = await lease.acquire()
        except HUB_FAULTS as exc:
            await self._give_back(task, msg, exc)
            return
        if not acquired:
            # Someone holds the run and renews it: this copy is a duplicate. Look again
            # after a third of the TTL, in case the holder has died by then.
            await msg.nak(delay=self.settings.lease_ttl_s / 3)
            return
        scope = Scope(self.js, self.runs, lease, msg, self.settings.worker_id, self.site)
        await self._start(task, lease, msg, scope, record)

    async def _not_to_run(self, task: Task, msg: Msg, record: RunRecord) -> bool:
        """Answer a task its run's record says not to run now; True if it was answered."""
        if record.state is RunState.QUEUED and not record.admitted:
            if task.dispatch >= record.dispatch:
                # The scheduler admits a run before it publishes its task: a record that
                # says otherwise of this dispatch is an older revision, read from a replica
                # still catching up (a clustered hub's node just back). Look again soon.
                await msg.nak(delay=STALE_RECORD_S)
            else:  # a task of a run requeued since: the scheduler publishes a new one
                await msg.ack()
            return True
        if record.state.terminal or record.state is RunState.PAUSED or record.site:
            # A duplicate of a run that is already over, or that waits for a human (whose
            # resume queues a task of its own), or one granted to a site, whose own queue
            # holds its task.
            await msg.ack()
            return True
        return False

    async def _give_back(self, task: Task, msg: Msg, exc: Exception) -> None:
        """The hub did not answer while this trainer took the run (a clustered hub electing
        a leader, a link down): its task goes back, and comes again once the hub answers.
        A lease write that landed unheard is this worker's, and lapses after its TTL."""
        log.warning("%s: could not take the run (%r); its task goes back", task.run_id, exc)
        with contextlib.suppress(Exception):
            await msg.nak(delay=GIVE_BACK_S)

    async def _start(
        self, task: Task, lease: Lease, msg: Msg, scope: Scope, record: RunRecord
    ) -> None:
        """With the run's lease held: refuse it, end it as it was asked, or train it."""
        if not self.settings.allows(task.spec.entry_point):
            await apply(self._refusal(task), scope)
        elif record.cancel_requested is not None:
            # Asked to cancel, and its trainer is gone: nothing trains it, so it is
            # cancelled here, before any work starts.
            await apply(Verdict(Outcome.CANCELLED, change=transitions.cancel_unowned), scope)
        elif record.pause_requested is not None:  # likewise, asked to pause
            await apply(Verdict(Outcome.PAUSED, change=transitions.pause_unowned), scope)
        elif record.preempt is not None and not record.preempt.to_ranks:
            # Asked to make room, and its trainer went before it could: queued again.
            await apply(Verdict(Outcome.REQUEUED, change=transitions.requeue_unowned), scope)
        elif task.spec.max_ranks > 1:
            await self._lead(task, lease, msg, scope, record)
        else:
            await self._held(task, lease, msg, scope)

    async def _held(
        self, task: Task, lease: Lease, msg: Msg, scope: Scope, group: Leader | None = None
    ) -> None:
        site = task.grant.site if task.grant is not None else ""
        claim = Claim(run_id=task.run_id, lease_key=lease.key, token=lease.token, site=site)
        self.workdir.hold(claim)
        try:
            await self._attempt(task, lease, msg, scope, group)
        finally:
            self.workdir.let_go()

    async def _lead(
        self, task: Task, lease: Lease, msg: Msg, scope: Scope, record: RunRecord
    ) -> None:
        """Form the run's group as its rank 0, then run the attempt over it; or give the
        task back, saying why in the record (`group.py`)."""
        groups = self.site_groups if task.grant is not None else None
        leader = Leader(
            self.nc, self.js, groups or self.groups, scope.runs, task, lease, record,
            self.settings.worker_id, self.settings.host_addr, self.site, groups is not None,
            self.groups if groups is not None else self.site_groups,
        )  # fmt: skip
        try:
            formed = await leader.form(msg, self.draining.leave, self.settings.form_wait_s)
        except Superseded:
            await leader.end()
            log.warning("%s: the run moved on while its group formed", task.run_id)
            await apply(Verdict(Outcome.FENCED, quiet=True), scope)
            return
        except Exception:
            # The hub failed under the forming group where nothing expected it: as for an
            # attempt (`_attempt`), the run is given back for a later try.
            log.exception("%s: forming its group failed", task.run_id)
            await leader.end()
            with contextlib.suppress(Exception):
                await apply(Verdict(Outcome.PREEMPTED, delay=ATTEMPT_ERROR_DELAY_S), scope)
            return
        except BaseException:
            await leader.end()
            raise
        if isinstance(formed, GaveWay):
            await leader.end()
            log.info("%s: no group yet: %s", task.run_id, formed.reason)
            change = transitions.wait(formed.reason, lease.token)
            await apply(Verdict(Outcome.PREEMPTED, change=change, delay=formed.delay), scope)
            return
        await self._held(task, lease, msg, scope, leader)

    async def on_call(self, msg: Msg, groups: GroupStore | None = None) -> None:
        """A group's leader calls for a rank: hold it if the group is still forming (in
        `groups`: a granted run's, at its site; else the hub's)."""
        try:
            call = decode(msg.data, RankCall)
        except ContractError as exc:
            await dead_letter(self.js, msg, "trainer", str(exc), site=self.site)
            await msg.term()
            return
        await self.zygote.warm()
        member = Member(
            groups or self.groups, self.zygote, call, self.settings.worker_id, self.store.url,
            Path(self.settings.work_dir), (self.draining.leave, self.signals.hurry),
            self._publish_output, self.settings.ack_wait_s, self.site,
            self.groups if groups is not None else self.site_groups,
        )  # fmt: skip
        self.attempt = member
        try:
            await member.run(msg)
        except Exception:
            # The hub or the store failed under the rank: the leader sees this rank's key
            # go and forms its group again; this trainer lives on.
            log.exception("%s: holding rank %d failed", call.task.run_id, call.rank)
        finally:
            self.attempt = None

    async def _publish_output(self, run_id: str, chunk: bytes) -> None:
        with contextlib.suppress(Exception):  # best effort, as the leader's (`attempt.py`)
            subject = names.at_site(names.logs_subject(run_id), self.site)
            await self.js.publish(subject, chunk, timeout=2)

    async def _attempt(
        self, task: Task, lease: Lease, msg: Msg, scope: Scope, group: Leader | None
    ) -> None:
        child = await self.zygote.fork()
        # SIGTERM or a drain: either way the run hands over at its next checkpoint.
        signals = (self.draining.leave, self.signals.hurry)
        check = None
        if task.grant is not None and self.granted is not None:
            check = self.granted.check(task.grant)
        await self.policy.current()
        attempt = Attempt(
            self.nc, self.settings, self.store, scope.runs, self.pools, task, lease, child,
            signals, self.beat_now, group, check, device=self.presence.device[0],
            leaving=self.draining.why,
        )  # fmt: skip
        self.attempt = attempt
        try:
            outcome = await attempt.run(msg)
            log.info("%s: attempt %s", task.run_id, outcome.value)
        except Exception:
            # The store or the hub failed under the attempt where nothing expected it (the
            # store down when the attempt looks up its checkpoint): the run is not at fault,
            # and this trainer must live on. Give the run back for a later try.
            log.exception("%s: the attempt failed outside the training process", task.run_id)
            with contextlib.suppress(Exception):
                await apply(Verdict(Outcome.PREEMPTED, delay=ATTEMPT_ERROR_DELAY_S), scope)
        finally:
            self.attempt = None

    def _refusal(self, task: Task) -> Verdict:
        """An entry point outside this trainer's allow-list: the run fails here, before the
        child imports anything, because whoever may publish jobs must not be able to run
        arbitrary code on a GPU host."""
        module = task.spec.entry_point.partition(":")[0]
        allowed = ", ".join(self.settings.entry_allow)
        reason = f"entry point module {module!r} is not allowed here (allowed: {allowed})"
        log.warning("%s: refused: %s", task.run_id, reason)
        return Verdict(Outcome.FAILED, change=transitions.fail(reason))
