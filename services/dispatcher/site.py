"""The site's dispatcher: jobs submitted at a site are dispatched there, link or no link.

A job submitted at a site (`baton submit --site`) lands in the site's own `BATON_SUBMIT`
stream, in the site's domain. This dispatcher takes it with the hub's rules — the same
spec validation, the same run id (`run_id_for(key, owner)`, the owner being the subject's
last token, which the servers enforce), the same idempotency — and makes the run a grant
to its own site from the start: its record, under the site's own first epoch
(`grants.site_epoch`: no other side issues tokens of it), in the site's runs bucket, and
its task, carrying that record, in the site's work queue, where the site's trainers take
it as any run the hub granted (`services/trainer/granted.py`). Its events go through the
outbox. The hub takes the record in at heal (`services/reaper/grants.py`): one run per id.

It first asks the hub whether the run id exists there (in the runs bucket or the archive):
a repeat of a job the hub knows is answered as the hub would answer it (`accepted`,
duplicate, or refused for another spec under the same key), and never run again. Cut off,
it reads the site's copy of the hub's records instead (`BATON_HUB_RUNS`, sourced from the
hub while the link is up): every id the hub used before the cut is known there. Only the
same job submitted at the hub *during* the cut (or just before it, past the copy) can run at
both sides: a job accepted while cut off is answered `unconfirmed`, and at heal the
checkpoint store decides which side's run counts (`shared.state.owner`; docs/sites.md,
"Submitting at a site").

A job of a pool none of the site's trainers serve is rejected here, saying so: nothing at
the site could ever start it; so is a run of several ranks when the site has fewer live
trainers of its pool than ranks. One it has the trainers for forms its group at the site,
as a group granted there does (`services/trainer/group.py`). Elastic and replicated runs
are submitted at the hub.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.backoff import Backoff, retrying
from shared.bus import names
from shared.bus.answer import handle
from shared.bus.connect import UNAVAILABLE, publish
from shared.bus.service import pull_loop
from shared.bus.streams import dispatcher_consumer, ensure_consumer
from shared.config import Settings
from shared.contracts import JobSpec, RunRecord, RunState, Task, decode, encode, spec_hash
from shared.contracts.control import WorkerInfo
from shared.contracts.events import Accepted, Event, Rejected, kind_of
from shared.contracts.jobs import MAX_SPEC_BYTES
from shared.contracts.records import run_id_for
from shared.errors import ContractError
from shared.state import grants
from shared.state.runs import Runs

log = logging.getLogger("baton.dispatcher")

HUB_READ_S = 3.0


class SiteDispatcher:
    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.hub: JetStreamContext = nc.jetstream(domain=settings.hub_domain)
        self.settings = settings
        self.site = settings.site
        self.runs: Runs
        self._hub_runs: Runs | None = None

    async def on_reconnect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def start(self) -> None:
        async def declare() -> None:
            await ensure_consumer(self.js, names.SUBMIT_STREAM, dispatcher_consumer(self.site))
            self.runs = await Runs.open(self.js, bucket=names.site_runs_bucket(self.site))

        # The site's checkpointer declares the site's streams and buckets: until it has,
        # they are not found.
        await retrying(
            declare, retry_on=(*UNAVAILABLE, NotFoundError),
            what="the site's streams are not declared yet", backoff=Backoff(first=0.5, most=5.0),
            log=log,
        )  # fmt: skip

    async def serve(self, stop: asyncio.Event) -> None:
        await pull_loop(
            self.js, names.SUBMIT_STREAM, names.DISPATCHER_CONSUMER, stop,
            lambda msg: handle(self.js, msg, "dispatcher", self.on_submission, site=self.site),
        )  # fmt: skip

    async def on_submission(self, msg: Msg) -> None:
        parts = msg.subject.split(".")  # baton.site.<site>.submit.<pool>[.<owner>]
        pool, owner = parts[4], parts[5] if len(parts) > 5 else ""
        key = (msg.headers or {}).get("Nats-Msg-Id") or f"seq-{msg.metadata.sequence.stream}"
        try:
            spec = decode(msg.data, JobSpec, max_bytes=MAX_SPEC_BYTES)
            if spec.pool != pool:
                raise ContractError(f"pool {spec.pool!r} differs from the subject's {pool!r}")
            if spec.elastic:
                raise ContractError("an elastic run is submitted at the hub", "$.ranks")
            if spec.replicated or spec.replica is not None:
                raise ContractError("a replicated run is submitted at the hub", "$.replicas")
            if not await self._serves(pool):
                raise ContractError(
                    f"no trainer of pool {pool!r} at site {self.site}: submit it at the hub",
                    "$.pool",
                )
            if spec.max_ranks > 1 and (have := await self._trainers(pool)) < spec.max_ranks:
                raise ContractError(
                    f"a run of {spec.max_ranks} ranks needs as many trainers of pool {pool!r}; "
                    f"site {self.site} has {have}: submit it at the hub",
                    "$.ranks",
                )
        except ContractError as exc:
            run_id = run_id_for(key, owner)
            await self._emit(Rejected(run_id=run_id, reason=exc.reason, path=exc.path))
            raise
        await self.dispatch(spec, spec.idempotency_key or key, owner)

    async def dispatch(self, spec: JobSpec, key: str, owner: str) -> None:
        run_id = run_id_for(key, owner)
        known, asked = await self._at_hub(run_id)
        if known is not None:
            await self._same_job(known, spec)
            log.info("%s: known at the hub already; not run again", run_id)
            await self._accepted(spec, run_id, duplicate=True)
            return
        now = time.time()
        record = RunRecord(
            run_id=run_id, spec=spec, spec_hash=spec_hash(spec), created_at=now,
            updated_at=now, on_failure=spec.on_failure or "retry", site=self.site,
            epoch=grants.site_epoch(self.site),
        )  # fmt: skip
        duplicate = not await self.runs.adopt(record)
        if duplicate:
            found = await self.runs.get(run_id)
            assert found is not None
            record = found[0]
            await self._same_job(record, spec)
        if record.state is RunState.QUEUED and record.epoch == grants.site_epoch(self.site):
            task = Task(run_id=run_id, spec=spec, dispatch=record.dispatch, grant=record)
            await publish(
                self.js, names.site_task_subject(self.site, spec.pool, run_id), encode(task),
                msg_id=f"grant.{run_id}.{record.epoch}",
            )  # fmt: skip
        if not asked:
            log.warning("%s: accepted while cut off from the hub: if the hub ran it too, the "
                        "store decides at heal", run_id)  # fmt: skip
        await self._accepted(spec, run_id, duplicate=duplicate, unconfirmed=not asked)
        log.info("%s %s (%s) at site %s", "re-accepted" if duplicate else "accepted", run_id,
                 spec.name, self.site)  # fmt: skip

    async def _same_job(self, record: RunRecord, spec: JobSpec) -> None:
        """Refuse, and answer so, a key used before for another spec (as the hub does)."""
        if record.spec_hash != spec_hash(spec):
            reason, path = (
                "idempotency key was already used for a different job spec",
                "$.idempotency_key",
            )
            await self._emit(Rejected(run_id=record.run_id, reason=reason, path=path))
            raise ContractError(reason, path)

    async def _at_hub(self, run_id: str) -> tuple[RunRecord | None, bool]:
        """The hub's record of `run_id` (live or archived), None if the hub has none; and
        whether the hub itself answered. Read from the site's copy of the hub's records
        when the hub cannot be asked (a cut): the copy holds what had reached it when the
        link went, which may be behind the hub by a moment."""
        try:
            async with asyncio.timeout(HUB_READ_S):
                if self._hub_runs is None:
                    self._hub_runs = await Runs.open(self.hub, self.settings.hub_api)
                return await self._hub_runs.find(run_id), True
        except Exception as exc:
            log.info("%s: the hub cannot be asked (%s); reading its records as copied", run_id, exc)
        return await self._copied(run_id), False

    async def _copied(self, run_id: str) -> RunRecord | None:
        """`run_id`'s record in the site's copy of the hub's records: the live one, else the
        archived one (a record the runs bucket let go of is in the archive)."""
        for subject in (f"$KV.{names.RUNS_BUCKET}.{run_id}", names.archive_subject(run_id)):
            try:
                msg = await self.js.get_last_msg(names.HUB_RUNS_STREAM, subject, direct=True)
            except NotFoundError:
                continue
            if msg.data and (msg.headers or {}).get("KV-Operation") not in ("DEL", "PURGE"):
                return decode(msg.data, RunRecord)
        return None

    async def _serves(self, pool: str) -> bool:
        """Some trainer of `pool` at this site has a consumer of the site's work queue."""
        try:
            await self.js.consumer_info(names.TASKS_STREAM, names.trainer_consumer(pool))
        except NotFoundError:
            return False
        return True

    async def _trainers(self, pool: str) -> int:
        """Trainers of `pool` at this site, not drained, whose heartbeat is still in the
        outbox: each lives there for its TTL (`names.heartbeat_subject`), so a trainer gone
        for longer is not counted, link or no link."""
        beats = names.site_root(self.site, "workers")
        info = await self.js.stream_info(names.OUTBOX_STREAM, subjects_filter=beats)
        count = 0
        for subject in info.state.subjects or {}:
            with contextlib.suppress(NotFoundError, ContractError):
                msg = await self.js.get_last_msg(names.OUTBOX_STREAM, subject)
                beat = decode(msg.data or b"", WorkerInfo)
                if beat.pool == pool and not beat.drained:
                    count += 1
        return count

    async def _accepted(
        self, spec: JobSpec, run_id: str, *, duplicate: bool, unconfirmed: bool = False
    ) -> None:
        accepted = Accepted(
            run_id=run_id, name=spec.name, pool=spec.pool, total_steps=spec.total_steps,
            duplicate=duplicate, unconfirmed=unconfirmed,
        )  # fmt: skip
        await self._emit(accepted, msg_id=None if duplicate else f"accepted.{run_id}")

    async def _emit(self, event: Event, msg_id: str | None = None) -> None:
        subject = names.at_site(names.event_subject(event.run_id, kind_of(event)), self.site)
        await publish(
            self.js, subject, encode(event),
            msg_id=msg_id or f"{kind_of(event)}.{event.run_id}.{time.time_ns()}",
        )  # fmt: skip
