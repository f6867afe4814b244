"""The dispatcher: submissions in, run records and tasks out.

Idempotency rests on two facts. The run id is a function of the idempotency key, so one
key names one run and the KV `create` lets exactly one submission make its record. The task
is published with `Nats-Msg-Id = task.<run>.<dispatch>`, so every submission of that key —
concurrent, redelivered, or retried after a crash between the two writes — publishes the
same task id, and the stream keeps one copy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import names
from shared.config import Settings
from shared.connect import publish
from shared.contracts import (
    JobSpec,
    RunRecord,
    RunState,
    Task,
    decode,
    encode,
    run_id_for,
    spec_hash,
)
from shared.contracts.events import Accepted, Rejected
from shared.contracts.jobs import MAX_SPEC_BYTES
from shared.errors import ContractError
from shared.events import emit
from shared.outcome import handle
from shared.runs import Runs
from shared.service import pull_loop
from shared.streams import dispatcher_consumer, ensure, ensure_consumer

log = logging.getLogger("baton.dispatcher")


class Dispatcher:
    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.runs: Runs

    async def start(self) -> None:
        await ensure(self.js)
        await ensure_consumer(self.js, names.SUBMIT_STREAM, dispatcher_consumer())
        self.runs = await Runs.open(self.js)

    async def serve(self, stop: asyncio.Event) -> None:
        await pull_loop(
            self.js,
            names.SUBMIT_STREAM,
            names.DISPATCHER_CONSUMER,
            stop,
            lambda msg: handle(self.js, msg, "dispatcher", self.on_submission),
            batch=10,
        )

    async def on_submission(self, msg: Msg) -> None:
        pool = names.pool_from_submit_subject(msg.subject)
        key = _fallback_key(msg)
        try:
            spec = decode(msg.data, JobSpec, max_bytes=MAX_SPEC_BYTES)
            if spec.pool != pool:
                raise ContractError(
                    f"pool {spec.pool!r} differs from the subject's pool {pool!r}", "$.pool"
                )
        except ContractError as exc:
            run_id = run_id_for(_key_from_raw(msg.data) or key)
            await emit(self.js, Rejected(run_id=run_id, reason=exc.reason, path=exc.path))
            log.info("rejected submission on %s: %s", msg.subject, exc)
            raise
        await self.dispatch(spec, spec.idempotency_key or key)

    async def dispatch(self, spec: JobSpec, key: str) -> None:
        run_id = run_id_for(key)
        now = time.time()
        record = RunRecord(
            run_id=run_id, spec=spec, spec_hash=spec_hash(spec), created_at=now, updated_at=now
        )
        duplicate = not await self.runs.create(record)
        if duplicate:
            found = await self.runs.get(run_id)
            assert found is not None  # records are never deleted
            record = found[0]
            if record.spec_hash != spec_hash(spec):
                reason = "idempotency key was already used for a different job spec"
                rejected = Rejected(run_id=run_id, reason=reason, path="$.idempotency_key")
                await emit(self.js, rejected)
                raise ContractError(reason, "$.idempotency_key")
        if record.state is RunState.QUEUED:
            # Also on a duplicate: the first submission may have died before this publish.
            task = Task(run_id=run_id, spec=spec, dispatch=record.dispatch)
            await publish(
                self.js,
                names.task_subject(spec.pool, run_id),
                encode(task),
                msg_id=f"task.{run_id}.{record.dispatch}",
            )
        await emit(
            self.js,
            Accepted(
                run_id=run_id,
                name=spec.name,
                pool=spec.pool,
                total_steps=spec.total_steps,
                duplicate=duplicate,
            ),
            msg_id=f"accepted.{run_id}" if not duplicate else None,
        )
        verb = "re-accepted" if duplicate else "accepted"
        log.info("%s %s (%s) on pool %s", verb, run_id, spec.name, spec.pool)


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
