"""The dispatcher: submissions in, run records and tasks out.

Idempotency rests on two facts. The run id is a function of the idempotency key, so one
key names one run and the KV `create` lets exactly one submission make its record. The task
is published with `Nats-Msg-Id = task.<run>.<dispatch>`, so every submission of that key —
concurrent, redelivered, or retried after a crash between the two writes — publishes the
same task id, and the stream keeps one copy.

Tracing: a submission's headers carry the submitter's trace context; the `dispatch` span
continues that trace, and the task's headers carry it on to the trainers (never the Task
itself: the contract is the same with tracing on or off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from opentelemetry import trace

from services.dispatcher.delegation import Delegation
from services.dispatcher.scheduler import Scheduler
from services.dispatcher.steering import Steering
from services.dispatcher.terms import Terms, resolve_priority
from shared import telemetry
from shared.bus import names
from shared.bus.answer import handle
from shared.bus.emit import emit
from shared.bus.service import pull_loop
from shared.bus.streams import (
    cancel_consumer,
    declared,
    dispatcher_consumer,
    ensure,
    ensure_consumer,
)
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.config import Settings
from shared.contracts import (
    JobSpec,
    RunRecord,
    RunState,
    decode,
    encode,
    run_id_for,
    spec_hash,
)
from shared.contracts.control import CancelRequest, Command
from shared.contracts.events import Accepted, Rejected
from shared.contracts.jobs import MAX_SPEC_BYTES
from shared.contracts.ledger import Hold
from shared.contracts.records import replica_run_id
from shared.credentials import lease_secret
from shared.errors import ContractError
from shared.ledger.holds import Holds, Settled, reckon
from shared.state import transitions
from shared.state.endings import settle
from shared.state.policy import FRESH_S, Policy, PoolsFile, load_table
from shared.state.pools import Pools
from shared.state.runs import Runs
from shared.waits import wait_set

log = logging.getLogger("baton.dispatcher")


class Dispatcher:
    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.runs: Runs
        self.lease_secret = lease_secret()
        """Keys each run's lease (`shared.state.lease.lease_key`), handed out in its tasks."""
        self._checking: asyncio.Task[None] | None = None
        """The look, after a reconnect, for buckets the hub came back without the newest
        writes of (`Scheduler.check_followed`)."""

    async def on_reconnect(self) -> None:
        self.scheduler.now.set()  # pull consumers resume by themselves once NATS is back
        self._checking = asyncio.create_task(self.scheduler.check_followed())

    async def close(self) -> None:
        await self.scheduler.stop()

    async def start(self) -> None:
        async def declare() -> None:
            await ensure(self.js, self.settings.replicas)
            await ensure_consumer(self.js, names.SUBMIT_STREAM, dispatcher_consumer())
            await ensure_consumer(self.js, names.CANCEL_STREAM, cancel_consumer())

        await declared(declare, log)
        self.runs = await Runs.open(self.js)
        self.policy = Policy(self.js, load_table(self.settings.pools_file))
        self.pools_file = PoolsFile(self.settings.pools_file, self.policy)
        await self.pools_file.check()
        self.pools = Pools(self.js, self.policy)
        self.holds = Holds(self.nc)
        self.steering = Steering(self.nc, self.runs, self.pools, self.holds)
        self.delegation = Delegation(self.nc, self.runs, self.settings)
        self.scheduler = Scheduler(
            self.nc, self.runs, self.policy, self.delegation, self.lease_secret, self.settings
        )
        self.steering.scheduler = self.scheduler
        await self.scheduler.start()

    async def serve(self, stop: asyncio.Event) -> None:
        await asyncio.gather(
            pull_loop(
                self.js,
                names.SUBMIT_STREAM,
                names.DISPATCHER_CONSUMER,
                stop,
                lambda msg: handle(self.js, msg, "dispatcher", self.on_submission),
                # Each submission waits on a few round trips (record, task, event): many at
                # once keep the connection busy. Safe because the run id and the KV create
                # make the record once, and the task's message id makes it once, whichever
                # copy of a submission gets there first.
                batch=self.settings.dispatch_concurrency,
                concurrency=self.settings.dispatch_concurrency,
            ),
            pull_loop(
                self.js,
                names.CANCEL_STREAM,
                names.CANCEL_CONSUMER,
                stop,
                lambda msg: handle(self.js, msg, "dispatcher", self.on_request),
            ),
            self.scheduler.serve(stop),
            self._follow_pools_file(stop),
        )

    async def _follow_pools_file(self, stop: asyncio.Event) -> None:
        """`BATON_POOLS_FILE` applied again whenever it changes (`shared.state.policy`)."""
        while not stop.is_set():
            await wait_set(stop, FRESH_S)
            with contextlib.suppress(Exception):  # the hub electing a leader: next time
                await self.pools_file.check()

    async def on_submission(self, msg: Msg) -> None:
        # A rejection propagates out of the span, which records it as an error.
        attributes = {"messaging.destination.name": msg.subject}
        with telemetry.consumer_span("dispatch", msg.headers, attributes):
            await self._on_submission(msg)

    async def _on_submission(self, msg: Msg) -> None:
        pool = names.pool_from_submit_subject(msg.subject)
        owner = names.owner_from_submit_subject(msg.subject)
        key = _fallback_key(msg)
        try:
            spec = decode(msg.data, JobSpec, max_bytes=MAX_SPEC_BYTES)
            if spec.pool != pool:
                raise ContractError(
                    f"pool {spec.pool!r} differs from the subject's pool {pool!r}", "$.pool"
                )
        except ContractError as exc:
            run_id = run_id_for(_key_from_raw(msg.data) or key, owner)
            await emit(self.js, Rejected(run_id=run_id, reason=exc.reason, path=exc.path))
            log.info("rejected submission on %s: %s", msg.subject, exc)
            raise
        await self.dispatch(spec, spec.idempotency_key or key, owner)

    async def dispatch(self, spec: JobSpec, key: str, owner: str = "") -> None:
        run_id = run_id_for(key, owner)
        trace.get_current_span().set_attributes(
            {telemetry.RUN_ID: run_id, telemetry.POOL: spec.pool}
        )
        if spec.replica is not None:
            reason = "replica is set by the dispatcher on each replica's run, not by a submitter"
            await emit(self.js, Rejected(run_id=run_id, reason=reason, path="$.replica"))
            raise ContractError(reason, "$.replica")
        runs = [(run_id, spec)]
        if spec.replicated:  # each replica its own run, placed wherever its pool has a trainer
            runs = [
                (replica_run_id(run_id, i), msgspec.structs.replace(spec, replica=i))
                for i in range(spec.max_replicas)
            ]
        try:  # everything that may refuse the job, before its credits are held
            terms = await self._terms(spec, owner, runs)
        except ContractError as exc:
            await emit(self.js, Rejected(run_id=run_id, reason=exc.reason, path=exc.path))
            raise
        for one_id, one in runs:
            duplicate = await self._dispatch_run(one_id, one, terms)
            if spec.replicated:
                await self._accepted(one_id, one, duplicate)
        await self._accepted(run_id, spec, duplicate)
        verb = "re-accepted" if duplicate else "accepted"
        trace.get_current_span().set_attribute(telemetry.OUTCOME, verb)
        # One line per new run would be most of the log at thousands of submissions a
        # second (and a sixth of the dispatcher's time): new runs at DEBUG, repeats at INFO.
        level = logging.INFO if duplicate else logging.DEBUG
        log.log(level, "%s %s (%s) on pool %s", verb, run_id, spec.name, spec.pool)

    async def _terms(self, spec: JobSpec, owner: str, runs: list[tuple[str, JobSpec]]) -> Terms:
        """What the pool's table makes of the job as `owner` submits it: its priority and,
        for a pool with a price, its credits held (each run's, all or none). A priority the
        owner may not use, or a balance short of the holds, refuses the whole job."""
        pool = (await self.policy.current()).pool(spec.pool)
        priority = resolve_priority(spec, pool, owner)
        budget = await self._budget(spec)
        if not owner or not pool.priced():
            return Terms(priority=priority, budget=budget)
        known = await self.runs.find(runs[0][0])
        if known is not None:  # a submission again: its credits were held, or never were
            hold = known.holds[0] if known.holds else 0
            return Terms(priority=priority, budget=budget, price=known.price, hold=hold)
        estimate = await reckon(self.pools, spec, pool, spec.total_steps)
        wanted = [
            Hold(owner=owner, run_id=one_id, n=0, amount=estimate.amount, estimate=estimate.how)
            for one_id, _ in runs
        ]
        try:
            await self.holds.take(owner, wanted)
        except Settled as exc:
            # Its run id was used before and that run settled; its record is forgotten (the
            # archive dropped it), so a retry cannot be told from a new job: refused.
            raise ContractError(
                f"{exc.reason}: its idempotency key was used for a run that ended and whose "
                "record is no longer kept; submit it with a new idempotency key",
                "$.idempotency_key",
            ) from None  # fmt: skip
        return Terms(priority=priority, budget=budget, price=dict(pool.price), hold=estimate.amount)

    async def _dispatch_run(self, run_id: str, spec: JobSpec, terms: Terms) -> bool:
        """The run's record, for the scheduler to admit; whether it was there already."""
        now = time.time()
        estimate, hard_s = terms.budget
        soft_s = spec.limits.soft_timeout_s
        record = RunRecord(
            run_id=run_id,
            spec=spec,
            spec_hash=spec_hash(spec),
            created_at=now,
            updated_at=now,
            estimated_cost=estimate,
            deadline_at=now + hard_s if hard_s else None,
            soft_deadline_at=now + soft_s if soft_s else None,
            on_failure=spec.on_failure or self.pools.on_failure(spec.pool),
            priority=terms.priority,
            admitted=False,
            trace=telemetry.inject(),
            price=terms.price,
            holds=[terms.hold] if terms.price else [],
        )
        revision = await self.runs.create(record)
        duplicate = revision is None
        if duplicate:
            found = await self.runs.find(run_id)
            # A record leaves the runs bucket only after it is in the archive.
            assert found is not None
            record = found
            if record.spec_hash != spec_hash(spec):
                reason = "idempotency key was already used for a different job spec"
                rejected = Rejected(run_id=run_id, reason=reason, path="$.idempotency_key")
                await emit(self.js, rejected)
                raise ContractError(reason, "$.idempotency_key")
        # The scheduler admits it — publishes its task, or grants it to a site — when its
        # pool has room (also a duplicate's, whose first submission may have died before).
        if record.state is RunState.QUEUED:
            self.scheduler.observe(record, revision or 0)
        return duplicate

    async def _accepted(self, run_id: str, spec: JobSpec, duplicate: bool) -> None:
        accepted = Accepted(
            run_id=run_id, name=spec.name, pool=spec.pool, total_steps=spec.total_steps,
            duplicate=duplicate,
        )  # fmt: skip
        await emit(self.js, accepted, msg_id=f"accepted.{run_id}" if not duplicate else None)

    async def _budget(self, spec: JobSpec) -> tuple[float | None, float | None]:
        """The estimated cost, and the hard timeout the budget allows (docs/architecture.md,
        "Retention and budgets"); `ContractError` for an estimate over `limits.max_cost`."""
        rate = self.pools.rate(spec.pool)  # the table in force, read by `_terms` just now
        per_step = await self.pools.seconds_per_step(spec.pool)
        estimate = spec.total_steps * per_step * rate / 3600 if per_step is not None else None
        limit = spec.limits.max_cost
        if limit is not None and estimate is not None and estimate > limit:
            reason = (
                f"estimated cost {estimate:.2f} ({spec.total_steps} steps x {per_step:.3g} s/step"
                f" at {rate:g}/hour on pool {spec.pool!r}) is over max_cost {limit:g}"
            )
            raise ContractError(reason, "$.limits.max_cost")
        hard = spec.limits.hard_timeout_s
        if limit is not None and rate > 0:
            affordable = limit / rate * 3600
            hard = min(hard, affordable) if hard else affordable
        return estimate, hard

    async def on_request(self, msg: Msg) -> None:
        """A request about a run: a cancel, or an operator's steering."""
        if msg.subject.startswith(names.STEER_ALL[:-1]):
            await self.steering.on_request(msg)
        else:
            await self.on_cancel(msg)

    async def on_cancel(self, msg: Msg) -> None:
        """QUEUED runs are cancelled here and now; a RUNNING one is asked to stop, and its
        trainer checkpoints, stops the child, acks the task and marks it CANCELLED."""
        req = decode(msg.data, CancelRequest)
        if msg.subject != names.cancel_subject(req.run_id):
            # The subject is what the servers let a submitter publish on (its own runs');
            # a body naming another run would cancel what it may not touch.
            raise ContractError(f"run {req.run_id!r} differs from the subject's", "$.run_id")

        if not await self._sealed_first(req):
            return
        record = await settle(self.js, self.runs, req.run_id, transitions.cancel(req.reason))
        if record is None:
            log.info("cancel of %s: nothing to do (no such run, or already over)", req.run_id)
        elif record.state is RunState.CANCELLED:
            with contextlib.suppress(NotFoundError):  # its trainer would ack it on sight anyway
                queued = await self.js.get_last_msg(
                    names.TASKS_STREAM, names.task_subject(record.spec.pool, req.run_id)
                )
                assert queued.seq is not None
                await self.js.delete_msg(names.TASKS_STREAM, queued.seq)
        elif record.worker:
            wake = Command(run_id=req.run_id, action="wake", reason=req.reason)
            await self.nc.publish(names.control_subject(record.worker), encode(wake))


    async def _sealed_first(self, req: CancelRequest) -> bool:
        """Before a cancel ends a run here (one nothing trains), its chain is sealed in the
        store (`commit.seal`): a site training the same job under a grant the hub forgot
        commits nothing after it. False when the chain was final already — the run was
        trained to its end elsewhere, and the store decides (the site's report completes
        it here): nothing is cancelled."""
        found = await self.runs.get(req.run_id)
        ended = transitions.cancel(req.reason)(found[0]) if found is not None else None
        if ended is None or not ended.state.terminal:
            return True
        async with open_store(self.settings.store_url) as store:
            if await commit.seal(store, req.run_id, "cancelled"):
                return True
        log.warning("cancel of %s: its checkpoint chain is final already (trained to its end "
                    "elsewhere): not cancelled", req.run_id)  # fmt: skip
        return False


def _fallback_key(msg: Msg) -> str:
    """A key for submissions without one: the publisher's Nats-Msg-Id, else the stream
    sequence (stable across redeliveries of the same message)."""
    msg_id = (msg.headers or {}).get("Nats-Msg-Id")
    return msg_id or f"seq-{msg.metadata.sequence.stream}"


def _key_from_raw(data: bytes) -> str | None:
    """Best effort, for rejections: the key of a spec that failed validation."""
    try:
        raw = json.loads(data[:MAX_SPEC_BYTES])
    except (ValueError, RecursionError):
        return None
    key = raw.get("idempotency_key") if isinstance(raw, dict) else None
    return key if isinstance(key, str) and key else None
