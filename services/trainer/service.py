"""The trainer: pulls one task at a time from its pool and runs it under a lease.

The loop holds one task message at a time and answers it only through the outcome of its
attempt (see `attempt.py`). It never cancels a run because NATS went away: the child keeps
training through a blip, and the lease — not the connection — decides who owns the run.
Beside the loop: a heartbeat in the worker registry (`presence.py`: what it is and runs), a
pulse while it holds a run (`pulse.py`: that it is alive), and a subscription to
`baton.control.<worker>` for commands (wake up, kill an orphan, an operator's checkpoint). A
drained trainer (`drain.py`) fetches nothing, hands what it runs over at its next
checkpoint as on SIGTERM, and lives on until it is undrained.

At a site (`BATON_SITE`) the trainer is connected to the site's leaf node. It takes tasks
from the hub's work queue and reads and writes the hub's KV across the domain boundary
(`hub`: a JetStream context for the hub's domain, plus the API prefix for KV writes);
everything it publishes for the hub — events, logs, heartbeats, dead letters — goes to the
site's outbox, and its commit requests to the site's checkpointer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from services.trainer import notices
from services.trainer.attempt import Attempt
from services.trainer.child_proc import Zygote
from services.trainer.claim import WorkDir
from services.trainer.drain import Draining
from services.trainer.granted import Granted
from services.trainer.group import GaveWay, Leader, Superseded
from services.trainer.presence import Presence
from services.trainer.pulse import pulse
from services.trainer.rank import Member
from services.trainer.verdicts import Outcome, Scope, Verdict, apply
from shared import telemetry
from shared.backoff import Backoff, retrying
from shared.bus import names
from shared.bus.answer import dead_letter
from shared.bus.service import StopSignals, pull_loop
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.checkpoint.store import Store, open_store
from shared.config import Settings
from shared.contracts import RunRecord, RunState, Task, decode
from shared.contracts.control import Command
from shared.contracts.groups import RankCall
from shared.contracts.tasks import Claim
from shared.errors import ContractError
from shared.state import transitions
from shared.state.grants import epoch_of
from shared.state.groups import GroupStore, key_ttl
from shared.state.handover import hand_over
from shared.state.lease import Lease
from shared.state.policy import Policy, load_table
from shared.state.pools import Pools
from shared.state.runs import Runs

log = logging.getLogger("baton.trainer")

ATTEMPT_ERROR_DELAY_S = 5.0
STALE_RECORD_S = 1.0
NATS_SECRETS = ("NATS_PASSWORD", "NATS_PASSWORD_FILE", "NATS_AUTH_FILE", "NATS_CREDS", "NATS_NKEY")


class Trainer:
    def __init__(self, nc: Client, settings: Settings, signals: StopSignals) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.hub: JetStreamContext = (
            nc.jetstream(domain=settings.hub_domain) if settings.site else self.js
        )
        self.settings = settings
        self.site = settings.site
        self.signals = signals
        self.store: Store = open_store(settings.store_url)
        self.runs: Runs
        self.policy = Policy(self.hub, load_table(settings.pools_file), settings.hub_api)
        """The pools' table in force (rates): read again as attempts start."""
        self.pools = Pools(self.hub, self.policy, settings.hub_api)
        self.beat_now = asyncio.Event()
        self.draining = Draining(self.hub, settings.worker_id, signals.stop)
        """Set `leave` while stopping or drained: what the loop and every attempt stop on."""
        self.attempt: Attempt | Member | None = None
        self.presence = Presence(self.js, settings, self.draining, lambda: self.attempt)
        """Its heartbeat in the worker registry (`presence.py`)."""
        ttl = key_ttl(settings.lease_ttl_s)
        self.groups = GroupStore(self.hub, settings.hub_api, ttl)
        """The groups of the runs the hub holds."""
        self.site_groups = None
        if self.site:
            self.site_groups = GroupStore(self.js, None, ttl, names.site_groups_bucket(self.site))
        """At a site: the groups of the runs granted to it, formed there (`group.py`)."""
        self.zygote = Zygote(self._child_env())
        """Forks each attempt's training process from one that imported torch already."""
        self.workdir = WorkDir(Path(settings.work_dir))
        self.granted = Granted(self.js, self.hub, settings, self.store) if self.site else None
        """At a site: the runs the hub granted to it (`granted.py`)."""
        self._hub: asyncio.Task[None] | None = None
        """At a site: reaching the hub's streams, in the background (see `start`)."""

    async def start(self) -> None:
        # First of all: a predecessor under this identity that still lives keeps the lock,
        # and one that died left the lock to us (`claim.py`).
        self.workdir.lock()
        consumer = trainer_consumer(
            self.settings.pool, self.settings.ack_wait_s, self.settings.max_deliver
        )

        # The hub's services declare the streams and buckets (a trainer may not: least
        # privilege); a trainer that starts first, or at a site whose link is down, waits
        # for them — for the buckets too, which the dispatcher declares after the streams.
        async def declared() -> None:
            await ensure_consumer(self.hub, names.TASKS_STREAM, consumer)
            self.runs = await Runs.open(self.hub, self.settings.hub_api)
            await self.draining.read()  # drained before this start: take nothing

        claim = self.workdir.left_behind()
        if self.granted is None:
            await _until_reachable(declared, "the hub's streams and buckets")
            if claim is not None:
                await self._hand_over(claim)
        else:
            # At a site the hub may be out of reach (a trainer restarted during a cut): the
            # runs granted to the site are served at once, the hub's work once it answers.
            await _until_reachable(self.granted.open, "the site's work queue and buckets")
            if claim is not None and claim.site:
                await self._hand_over(claim)
                claim = None

            async def reach_hub() -> None:
                await _until_reachable(declared, "the hub's streams and buckets")
                if claim is not None:
                    await self._hand_over(claim)

            self._hub = asyncio.create_task(reach_hub())
        await self.zygote.start()
        await self.nc.subscribe(names.control_subject(self.settings.worker_id), cb=self._on_command)
        if not self.site:  # a probe finds it there while this process lives (`shared.bus.probe`)
            await self.nc.subscribe(names.alive_subject(self.settings.worker_id), cb=_unanswered)

    async def _hand_over(self, claim: Claim) -> None:
        """This worker's predecessor died during an attempt: free its lease and make its task
        deliverable now, instead of after the lease TTL and the task's AckWait."""
        if claim.site and self.granted is not None:  # a run granted to this site
            lease = Lease(
                self.js, claim.run_id, self.settings.worker_id, self.settings.lease_ttl_s,
                key=claim.lease_key, bucket=names.site_leases_bucket(claim.site),
                epoch=epoch_of(claim.token),
            )  # fmt: skip
            runs = self.granted.runs
        else:
            runs = self.runs
            lease = Lease(
                self.hub, claim.run_id, self.settings.worker_id, self.settings.lease_ttl_s,
                api_prefix=self.settings.hub_api, key=claim.lease_key,
                epoch=epoch_of(claim.token),
            )  # fmt: skip
        freed = await lease.abandon(claim.token)
        reason = "its trainer process died (its successor on the host found the claim)"
        handed = await hand_over(
            self.nc, self.js, runs, claim.run_id, claim.token, reason, site=self.site
        )
        self.workdir.let_go()
        log.warning(
            "%s: this worker's previous process died holding it (token %d); lease %s, task %s",
            claim.run_id, claim.token, "freed" if freed else "gone already",
            "handed over" if handed else "answered or handed over already",
        )  # fmt: skip

    async def on_reconnect(self) -> None:
        # Tell the running attempt to touch its task and renew its lease at once: the
        # in_progress sent while the link was down reached nobody.
        self.beat_now.set()

    async def close(self) -> None:
        return None  # serve() already stopped the zygote and closed the store

    async def serve(self, stop: asyncio.Event) -> None:
        """`stop` is the first signal; attempts also see the second (`hurry`). While
        drained, the loop fetches nothing and waits to be undrained (`drain.py`)."""
        watches = [self.presence.heartbeat(), self.presence.follow_drain()]
        watches += [self.draining.follow_stop()]
        if not self.site:  # that it is alive, while it holds a run (`pulse.py`)
            watches.append(pulse(self.nc, self.settings, lambda: self.attempt))
        if self.settings.cloud:  # a reclaim's notice drains it (`notices.py`)
            watches.append(notices.obeyed(self.settings, self.draining, self.presence.beat, stop))
        beside = [asyncio.create_task(c) for c in watches]
        try:
            # No task before an attempt could start at once: a task taken now would hold
            # its lease while torch imports, and could lapse before the first renewal.
            await self.zygote.warm()
            while not stop.is_set():
                await self.draining.until_undrained()
                if stop.is_set():
                    break
                if self.granted is not None:
                    await self._serve_site(self.draining.leave)
                else:
                    await pull_loop(
                        self.hub,
                        names.TASKS_STREAM,
                        names.trainer_consumer(self.settings.pool),
                        self.draining.leave,
                        self.on_task,
                    )
                self.presence.beat.set()  # drained and idle now (or stopping): say so at once
        finally:
            for t in beside:
                t.cancel()
            if self._hub is not None:
                self._hub.cancel()
            await self.zygote.stop()
            await self.store.close()
            self.workdir.unlock()

    async def _serve_site(self, leave: asyncio.Event) -> None:
        assert self.granted is not None
        await self.granted.serve(leave, self.hub, self._hub_reached, self.on_granted, self.on_task)

    def _hub_reached(self) -> bool:
        t = self._hub
        return t is not None and t.done() and not t.cancelled() and t.exception() is None

    async def on_granted(self, msg: Msg) -> None:
        """A run the hub granted to this site (`granted.py`), or a call for a rank of a
        granted run's group."""
        assert self.granted is not None and self.site_groups is not None
        if self.draining.drained:
            await msg.nak()
            return
        if msg.subject.startswith(names.site_calls_root(self.site)):
            await self.on_call(msg, self.site_groups)
            return
        await self.zygote.warm()
        await self.granted.on_task(msg, self._start)

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

    async def _on_command(self, msg: Msg) -> None:
        try:
            cmd = decode(msg.data, Command)
        except ContractError:
            return
        attempt = self.attempt
        if cmd.action == "kill" and attempt is not None and attempt.run_id == cmd.run_id:
            log.warning("%s: kill command: %s", cmd.run_id, cmd.reason)
            attempt.orphaned(cmd.reason)
        self.beat_now.set()
        if cmd.action == "wake" and await self.draining.refresh():
            self.presence.beat.set()

    def _child_env(self) -> dict[str, str]:
        # The training process talks to its trainer over a pipe, never to NATS: it gets no
        # NATS credentials, so user code cannot leak or use them.
        env = {k: v for k, v in os.environ.items() if k not in NATS_SECRETS}
        env["BATON_SPOOL"] = str(Path(self.settings.work_dir, "spool").resolve())
        if self.settings.snapshots_dir:  # shared by the host's trainers (`baton.runtime.local`)
            env["BATON_SNAPSHOTS"] = str(Path(self.settings.snapshots_dir).resolve())
        env["PYTHONUNBUFFERED"] = "1"
        # Required by cuBLAS for deterministic results; harmless without a GPU.
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        return env


async def _unanswered(msg: Msg) -> None:
    """A probe (`shared.bus.probe`): being there is the answer."""


HUB_FAULTS = (NatsError, TimeoutError, ConnectionError)
"""What the hub's servers answer (or fail to) while one is lost or a stream elects a leader."""
GIVE_BACK_S = 1.0
"""How long a task the hub would not let this trainer take stays off the queue."""

UNREACHABLE = (
    ServiceUnavailableError, NoRespondersError, TimeoutError, NatsTimeoutError, NotFoundError,
)  # fmt: skip


async def _until_reachable(call: Callable[[], Awaitable[None]], what: str) -> None:
    backoff = Backoff(first=0.5, most=5.0)
    await retrying(
        call, retry_on=UNREACHABLE, what=f"{what} is not reachable", backoff=backoff, log=log
    )
