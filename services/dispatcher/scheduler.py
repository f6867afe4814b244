"""The scheduler: which queued run starts next, where, and which running run makes room.

One place decides it (`shared.scheduling.plan`, pure); this module feeds it and carries its
decisions out. It follows the runs bucket and the trainers' heartbeats (KV watches: a
change costs nothing to notice, nothing is polled), keeps each pool's decayed usage per
owner, and runs a pass over a pool whenever something there changed — a submission, a
run that ended or was requeued, a trainer that came, went or was drained — and once a
second besides (a run reaching `min_run_s`, usage moving on).

Every decision is a compare-and-swap on a run record, so a decision taken on a view that
is a moment old is refused rather than carried out twice: `admit` (then the task is
published, `shared.state.tasks`), a grant to a site (`delegation.py`), `ask_preempt` (then
a `wake` to the holder, whose lease keeper reads the order at once: the attempt
checkpoints and the run is requeued, or its elastic group re-forms smaller), `cap_ranks`.
Two dispatchers would over-admit, never lose a run or preempt one twice.

Invariant: a QUEUED run that is not `admitted` has no task in any work queue; every other
way into a work queue (a hand-over, a retry, a lost run found by the reaper) is a run the
scheduler already admitted and still counts against its pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from services.dispatcher.delegation import Delegation
from services.dispatcher.queues import Reckoner, view_of
from services.dispatcher.speeds import Speeds
from shared import telemetry
from shared.backoff import Backoff, retrying
from shared.bus import names
from shared.bus.connect import UNAVAILABLE
from shared.bus.follow import Following
from shared.bus.kvwrite import KvWriter
from shared.config import Settings
from shared.contracts import RunRecord, decode, encode
from shared.contracts.control import Command, WorkerInfo
from shared.contracts.queue import QueueRequest
from shared.contracts.records import Preemption
from shared.errors import ContractError
from shared.scheduling.model import Action, Admit, Grant, PoolState, Preempt, SavedUsage
from shared.scheduling.plan import Pass, plan
from shared.state import transitions
from shared.state.policy import Policy
from shared.state.runs import Runs
from shared.state.tasks import publish_task
from shared.waits import wait_set

log = logging.getLogger("baton.scheduler")

ROUND_S = 1.0
"""A pass over every pool at least this often."""
READY_S = 30.0
"""How long the first pass waits for the runs and trainers stored to be read."""
GATHER_S = 0.01
"""How long a pass waits, once something changed, for what changes with it."""
KEEP_USAGE_S = 15.0
"""How often each pool's usage is written down, to outlive a restart."""
CONCURRENCY = 32
"""Decisions of one pass carried out at once."""
SAY_WAITING = 50
"""Queued runs whose records a pass tells why they wait, at most (the front of the queue:
`baton queue` says it of every run)."""


class Scheduler:
    def __init__(
        self,
        nc: Client,
        runs: Runs,
        policy: Policy,
        delegation: Delegation,
        lease_secret: bytes | None,
        settings: Settings,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.runs = runs
        self.policy = policy
        self.delegation = delegation
        self.lease_secret = lease_secret
        self.reckoner = Reckoner(settings)
        """What it knows of the pools: live records, trainers, usage (`queues.py`)."""
        self.speeds = Speeds(self.js, self.reckoner)
        """Job speeds, for the pools granted to a site by time (`speeds.py`)."""
        self.now = asyncio.Event()
        """Set to run a pass at once."""
        self._following: list[Following] = []
        self._writer = KvWriter(self.js, names.POOLS_BUCKET)
        self._kept = time.monotonic()
        self._limit = asyncio.Semaphore(CONCURRENCY)

    async def start(self) -> None:
        runs = Following(
            self.js, names.RUNS_BUCKET, self._on_record, on_reset=self.reckoner.forget_revisions
        )
        workers = Following(self.js, names.WORKERS_BUCKET, self._on_worker)
        self._following = [runs, workers]
        for f in self._following:
            await f.start()
        await self._restore_usage()
        await self.nc.subscribe(names.QUEUE_ALL, cb=self._on_queue_request)

    async def stop(self) -> None:
        for f in self._following:
            await f.close()
        with contextlib.suppress(Exception):
            await self._keep_usage()

    async def check_followed(self) -> None:
        """After a reconnect: follow the runs and trainers again from what the hub holds,
        also when it came back without its newest writes (`Following.check`); retried while
        JetStream is not answering yet."""

        async def check() -> None:
            if any([await f.check() for f in self._following]):
                log.warning("the hub came back without its newest writes: its runs and "
                            "trainers are read again")  # fmt: skip
                self.now.set()

        with contextlib.suppress(Exception):
            await retrying(
                check, retry_on=(*UNAVAILABLE, NotFoundError), what="the hub's buckets",
                backoff=Backoff(first=0.5, most=5.0), attempts=12, log=log,
            )  # fmt: skip

    def observe(self, record: RunRecord, revision: int = 0) -> None:
        """A record as its writer left it (the dispatcher, a decision of ours): the watch
        brings the same a moment later. A pass follows."""
        if self.reckoner.observe(record, revision):
            self.now.set()

    async def serve(self, stop: asyncio.Event) -> None:
        await self._until_read(stop)
        while not stop.is_set():
            if await wait_set(self.now, ROUND_S):
                # A burst of changes (submissions by the thousand) makes one pass, not one
                # each: what changes meanwhile is in the pass that follows.
                await wait_set(stop, GATHER_S)
            self.now.clear()
            if stop.is_set():
                break
            try:
                await self.round()
            except Exception as exc:  # the hub electing a leader, a restart: again soon
                log.warning("scheduling failed (%r); again in %.0fs", exc, ROUND_S)

    async def _until_read(self, stop: asyncio.Event) -> None:
        """No pass before the records and heartbeats stored now are read (or `READY_S`): a
        pass that saw half the runs training would count their trainers free."""
        async def read() -> None:
            for f in self._following:
                await f.ready.wait()

        reading = asyncio.create_task(read())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({reading, stopping}, timeout=READY_S,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            reading.cancel()
            stopping.cancel()
        if not all(f.ready.is_set() for f in self._following) and not stop.is_set():
            log.warning("the runs and trainers were not all read within %.0fs; scheduling "
                        "on what was", READY_S)  # fmt: skip

    async def round(self) -> list[Action]:
        """One pass over every pool; the decisions carried out."""
        table = await self.policy.current()
        self.reckoner.accrue(table)
        linked = await self.delegation.linked_sites(self.reckoner.site_pools())
        done: list[Action] = []
        for pool in self.reckoner.pools():
            if linked and self.reckoner.by_time(pool, table.pool(pool), linked):
                await self.speeds.refresh(pool)
            state = self.reckoner.state(pool, table.pool(pool), linked)
            decided = plan(state)
            _gauges(state)
            done += await self._carry_out(decided.actions)
            self.reckoner.blocked[pool] = decided.blocked
            await self._say_waiting(decided.waiting)
        await self.delegation.resend(self.reckoner.unsent_grants(linked))
        if time.monotonic() - self._kept >= KEEP_USAGE_S:
            await self._keep_usage()
        return done

    # -- carrying decisions out ----------------------------------------------------------

    async def _carry_out(self, actions: list[Action]) -> list[Action]:
        # Preemptions first: the room they make is what the admissions after them count on.
        ordered = sorted(actions, key=lambda a: not isinstance(a, Preempt))
        results = await asyncio.gather(*(self._one(a) for a in ordered))
        return [a for a, ok in zip(ordered, results, strict=True) if ok]

    async def _one(self, action: Action) -> bool:
        async with self._limit:
            try:
                return await self._do(action)
            except Exception as exc:
                log.warning("%s: %s not carried out (%r)", action.run_id, type(action).__name__,
                            exc)  # fmt: skip
                return False

    async def _do(self, action: Action) -> bool:
        seen = self.reckoner.record(action.run_id)
        if seen is None:
            return False
        if isinstance(action, Admit):
            return await self._admit(seen, action)
        if isinstance(action, Grant):
            granted = await self.delegation.grant(seen, action.site)
            if granted is not None:
                self.observe(granted)
            return granted is not None
        if isinstance(action, Preempt):
            return await self._preempt(seen, action)
        record = await self._change(action.run_id, transitions.cap_ranks(action.ranks))
        if record is not None:
            await self._wake(record, f"may grow to {action.ranks} ranks")
        return record is not None

    async def _admit(self, seen: RunRecord, action: Admit) -> bool:
        record = await self._change(action.run_id, transitions.admit(seen.dispatch, action.cap))
        if record is None:
            return False
        await publish_task(self.js, record, self.lease_secret, record.trace or None)
        log.info("%s: admitted (priority %d, %s)", record.run_id, record.priority,
                 record.owner or "operator")  # fmt: skip
        return True

    async def _preempt(self, seen: RunRecord, action: Preempt) -> bool:
        order = Preemption(
            by=action.by, kind=action.kind, reason=action.reason,  # type: ignore[arg-type]
            to_ranks=action.to_ranks,
        )  # fmt: skip
        record = await self._change(action.run_id, transitions.ask_preempt(seen.token, order))
        if record is None:
            return False
        await self._wake(record, f"make room for {action.by}")
        log.info("%s: asked to make room for %s (%s)", action.run_id, action.by, action.reason)
        by = self.reckoner.record(action.by)
        telemetry.PREEMPTIONS.add(1, {
            telemetry.POOL: record.spec.pool, "baton.kind": action.kind,
            telemetry.OWNER: record.owner or "operator",
            "baton.for_owner": (by.owner if by else "") or "operator",
        })  # fmt: skip
        return True

    async def _say_waiting(self, waiting: dict[str, str]) -> None:
        """Write why a queued run waits into its record (`baton status`), where it changed:
        the first `SAY_WAITING` such runs of the queue per pass, in its order."""
        changes = [
            (run_id, why) for run_id, why in waiting.items()
            if (r := self.reckoner.record(run_id)) is not None and r.waiting != why
        ][:SAY_WAITING]  # fmt: skip

        async def say(run_id: str, why: str) -> None:
            async with self._limit:
                with contextlib.suppress(Exception):  # advisory: said again next pass
                    await self._change(run_id, transitions.queued_because(why))

        await asyncio.gather(*(say(run_id, why) for run_id, why in changes))

    async def _change(self, run_id: str, change: transitions.Change) -> RunRecord | None:
        """A record change of the scheduler's, kept in its view at once (the watch brings
        the same revision a moment later)."""
        changed = await self.runs.change(run_id, change)
        if changed is None:
            return None
        self.observe(*changed)
        return changed[0]

    async def _wake(self, record: RunRecord, reason: str) -> None:
        if record.worker:
            wake = Command(run_id=record.run_id, action="wake", reason=reason)
            await self.nc.publish(names.control_subject(record.worker), encode(wake))

    # -- what it follows -----------------------------------------------------------------

    def _on_record(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None and entry.revision is not None
        with contextlib.suppress(ContractError):
            self.observe(decode(entry.value, RunRecord), entry.revision)

    def _on_worker(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None
        with contextlib.suppress(ContractError):
            if self.reckoner.heard(decode(entry.value, WorkerInfo)):
                self.now.set()

    # -- usage across restarts -----------------------------------------------------------

    async def _keep_usage(self) -> None:
        self._kept = time.monotonic()
        for pool, saved in self.reckoner.usage_snapshots().items():
            await self._writer.put(names.usage_key(pool), encode(saved))

    async def _restore_usage(self) -> None:
        kv = await self.js.key_value(names.POOLS_BUCKET)
        found: dict[str, SavedUsage] = {}
        with contextlib.suppress(Exception):  # none kept yet
            for key in await kv.keys():
                if key.startswith("usage."):
                    entry = await kv.get(key)
                    if entry.value:
                        found[key.removeprefix("usage.")] = decode(entry.value, SavedUsage)
        self.reckoner.restore_usage(found, await self.policy.current())

    # -- answering for a pool's queue ------------------------------------------------------

    async def _on_queue_request(self, msg: Msg) -> None:
        if not msg.reply:
            return
        pool = msg.subject.rpartition(".")[2]
        try:
            req = decode(msg.data, QueueRequest) if msg.data else QueueRequest()
        except ContractError as exc:
            await msg.respond(encode({"error": f"{exc.path}: {exc.reason}"}))
            return
        table = await self.policy.current()
        view = view_of(self.reckoner, pool, table.pool(pool), req.limit)
        await msg.respond(encode(view))


def _gauges(state: PoolState) -> None:
    """Each owner's trainers, entitlement and usage in the pool, as the pass saw them."""
    p = Pass(state)
    for owner, share in p.share.items():
        attrs = {telemetry.POOL: state.name, telemetry.OWNER: owner or "operator"}
        telemetry.OWNER_HOLDING.set(p.holding[owner], attrs)
        telemetry.OWNER_ENTITLED.set(share * state.trainers, attrs)
        telemetry.OWNER_USAGE.set(state.usage.get(owner, 0.0), attrs)
