"""The operators' actions on runs and trainers that the dashboard's page offers. Invariant:
each action checks first what the services would refuse — the CLI's own checks, against the
run's record and the store — and answers a refusal with its reason (400, or 404 for what
does not exist) having published and written nothing, so the page says why at once instead
of the request ending as a dead letter; then it does what the CLI command does. Every route
is made by `guard.action`, so none runs without the page's token.

    action             checks                                    then
    pause              QUEUED, or RUNNING and not asked yet      `Pause` on baton.steer.<run>
    resume             PAUSED                                    `Resume`
    checkpoint         RUNNING on a trainer                      `TakeCheckpoint`
    rollback (step)    not COMPLETED or CANCELLED; a committed   `Rollback`
                       checkpoint at the step on its chain, not  (`baton.client.rebase
                       final, every file verified                .ask_rollback`)
    fork (step)        a committed checkpoint at the step, on    the fork's spec submitted
                       the chain or abandoned, verified; the     (`baton.client.rebase.fork_spec`)
                       spec with its overrides valid
    drain, undrain     a worker id (undrain: a drained one)      its key in `baton_drains`

The dispatcher carries out a steering request by changing the run's record, which the page
follows; a drained trainer says so in its next heartbeat (the dashboard sends trainers no
command: `shared.auth.dashboard_permissions`).
"""

from __future__ import annotations

import time
import uuid

import msgspec
from nats.aio.client import Client
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from baton.client import calls as client
from baton.client import reader, rebase
from baton.client.errors import CliError
from baton.ui import params
from baton.ui.guard import action
from shared.bus import names
from shared.checkpoint import lineage
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunState, encode, run_id_for
from shared.contracts.control import Drain, Pause, Resume, Steer, TakeCheckpoint
from shared.contracts.events import Event, Rejected
from shared.errors import IntegrityError
from shared.state.drains import Drains

FORK_WAIT_S = 10.0
"""How long a fork waits for the dispatcher's `accepted` (or `rejected`) before it answers
with the new run's id alone."""
BY = "from the dashboard"
"""The reason recorded when the page gives none."""


class Actions:
    """The actions' handlers, over the dashboard's NATS connection and store."""

    def __init__(self, nc: Client, store_url: str | None) -> None:
        self.nc = nc
        self.store_url = store_url

    def routes(self, token: str) -> list[Route]:
        return [
            action("/api/runs/{run_id}/pause", self.pause, token),
            action("/api/runs/{run_id}/resume", self.resume, token),
            action("/api/runs/{run_id}/checkpoint", self.checkpoint, token),
            action("/api/runs/{run_id}/checkpoints/{step}/rollback", self.rollback, token),
            action("/api/runs/{run_id}/checkpoints/{step}/fork", self.fork, token),
            action("/api/workers/{worker}/drain", self.drain, token),
            action("/api/workers/{worker}/undrain", self.undrain, token),
        ]

    # -- a run ---------------------------------------------------------------------------

    async def pause(self, request: Request) -> Response:
        run_id, body = await _run_and_body(request)
        found = await client.record(self.nc, run_id)
        if found.state not in (RunState.QUEUED, RunState.RUNNING):
            state = found.state.value
            raise _refused(f"run {run_id} is {state}: only a queued or running run pauses")
        if found.pause_requested is not None:
            raise _refused(f"run {run_id} is pausing already ({found.pause_requested})")
        return await self._steer(Pause(run_id=run_id, reason=body.reason or f"paused {BY}"))

    async def resume(self, request: Request) -> Response:
        run_id, body = await _run_and_body(request)
        found = await client.record(self.nc, run_id)
        if found.state is not RunState.PAUSED:
            raise _refused(f"run {run_id} is {found.state.value}: only a paused run resumes")
        return await self._steer(Resume(run_id=run_id, reason=body.reason or f"resumed {BY}"))

    async def checkpoint(self, request: Request) -> Response:
        """As `baton checkpoint` (`baton.cli.drains.checkpoint`), without its wait: the page
        sees the checkpoint in the run's list once it is committed."""
        run_id, body = await _run_and_body(request)
        found = await client.record(self.nc, run_id)
        if found.state is not RunState.RUNNING or not found.worker:
            state = "between attempts" if found.state is RunState.RUNNING else found.state.value
            raise _refused(f"run {run_id} is {state}: only a run in training can checkpoint")
        return await self._steer(TakeCheckpoint(run_id=run_id, reason=body.reason or BY))

    async def rollback(self, request: Request) -> Response:
        run_id, body = await _run_and_body(request)
        step = params.number(request.path_params["step"], "step", low=0)
        before = await rebase.ask_rollback(
            self.nc, self._store(), run_id, step, body.reason or f"rolled back {BY}"
        )
        asked = {"asked": "rollback", "run_id": run_id, "step": step}
        return JSONResponse({**asked, "state": before.state.value})

    async def fork(self, request: Request) -> Response:
        """A new run from the run's checkpoint at `step`, its spec the run's with the body's
        `overrides` (`baton fork --set`); submitted as an operator's (no owner), since the
        dashboard's credentials are the operator's to keep."""
        run_id, body = await _run_and_body(request)
        step = params.number(request.path_params["step"], "step", low=0)
        parent = await client.record(self.nc, run_id)
        spec = rebase.fork_spec(parent, step, list(body.overrides), None, None)
        async with open_store(self._store()) as store:
            try:
                await lineage.find(store, run_id, step, anywhere=True)
            except IntegrityError as exc:
                raise CliError(str(exc), 3) from None
        forked, answer = await submit(self.nc, spec, FORK_WAIT_S)
        if isinstance(answer, Rejected):
            raise _refused(f"the dispatcher rejected the fork {forked}: {answer.reason}")
        verdict = "accepted" if answer is not None else None
        return JSONResponse({"run_id": forked, "parent": run_id, "step": step, "answer": verdict})

    async def _steer(self, req: Steer) -> Response:
        before = await client.steer(self.nc, req)
        asked = {"asked": req.action, "run_id": req.run_id}
        return JSONResponse({**asked, "state": before.state.value})

    # -- a trainer -------------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        worker = params.worker(request.path_params["worker"])
        body = await params.action_body(request)
        order = Drain(worker=worker, reason=body.reason or f"drained {BY}", at=time.time())
        await Drains(self.nc.jetstream()).drain(order)
        return JSONResponse({"drained": worker})

    async def undrain(self, request: Request) -> Response:
        worker = params.worker(request.path_params["worker"])
        await params.action_body(request)
        if not await Drains(self.nc.jetstream()).undrain(worker):
            raise _refused(f"trainer {worker} is not drained")
        return JSONResponse({"undrained": worker})

    def _store(self) -> str:
        if self.store_url is None:
            raise CliError(
                "no checkpoint store given, and the hub does not say: start `baton ui` with"
                " --store",
                2,
            )
        return self.store_url


async def _run_and_body(request: Request) -> tuple[str, params.ActionBody]:
    return params.run_id(request.path_params["run_id"]), await params.action_body(request)


def _refused(reason: str) -> CliError:
    return CliError(reason, 2)


async def submit(nc: Client, spec: JobSpec, wait_s: float) -> tuple[str, Event | None]:
    """Submit `spec` under a new idempotency key as an operator's job (no owner: the run id
    is `run_id_for(key)`, the subject `baton.submit.<pool>`), as `baton submit` does, and
    wait up to `wait_s` for the dispatcher's `accepted` or `rejected`: (run id, that event
    or None). The run's events are read from the first, so an answer stored before the
    read began is found all the same."""
    key = uuid.uuid4().hex
    spec = msgspec.structs.replace(spec, idempotency_key=key)
    run_id = run_id_for(key)
    events = await reader.read(nc, names.EVENTS_STREAM, names.events_of_run(run_id))
    try:
        await nc.jetstream().publish(
            names.submit_subject(spec.pool), encode(spec), headers={"Nats-Msg-Id": key}
        )
        return run_id, await reader.first(events, wait_s, client.answer_of)
    finally:
        await events.unsubscribe()
