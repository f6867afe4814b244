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
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg
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
from services.trainer.presence import Presence
from services.trainer.pulse import pulse
from services.trainer.rank import Member
from services.trainer.taking import Taking
from shared.backoff import Backoff, retrying
from shared.bus import names
from shared.bus.service import StopSignals, pull_loop
from shared.bus.streams import ensure_consumer, trainer_consumer
from shared.checkpoint.store import Store, open_store
from shared.config import Settings
from shared.contracts import decode
from shared.contracts.control import Command
from shared.contracts.tasks import Claim
from shared.errors import ContractError
from shared.state.grants import epoch_of
from shared.state.groups import GroupStore, key_ttl
from shared.state.handover import hand_over
from shared.state.lease import Lease
from shared.state.policy import Policy, load_table
from shared.state.pools import Pools
from shared.state.runs import Runs

log = logging.getLogger("baton.trainer")

NATS_SECRETS = ("NATS_PASSWORD", "NATS_PASSWORD_FILE", "NATS_AUTH_FILE", "NATS_CREDS", "NATS_NKEY")


class Trainer(Taking):
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



UNREACHABLE = (
    ServiceUnavailableError, NoRespondersError, TimeoutError, NatsTimeoutError, NotFoundError,
)  # fmt: skip


async def _until_reachable(call: Callable[[], Awaitable[None]], what: str) -> None:
    backoff = Backoff(first=0.5, most=5.0)
    await retrying(
        call, retry_on=UNREACHABLE, what=f"{what} is not reachable", backoff=backoff, log=log
    )
