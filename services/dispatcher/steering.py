"""Operators' requests that steer a run (`shared.contracts.control.Steer`): each one is a
change of the run record — the order itself, which the run's trainer reads — and a `wake`
to that trainer so it reads it now rather than at its next renewal.

A request that cannot apply to the run as it stands (no such run, a run already over, a
resume of a run that is not paused) raises `ContractError`: the request is dead-lettered
with that reason and nothing changes. The subject names the run (it is what the servers let
a submitter publish on); a body naming another run is refused the same way.

    request      record change                                  then
    pause        QUEUED: PAUSED; RUNNING: pause_requested        its trainer checkpoints
                                                                 and stops: PAUSED
    resume       PAUSED: QUEUED at the next dispatch (priced:    the scheduler admits it
                 checked PAUSED first, then a hold for
                 what its holds no longer cover, if any)
    checkpoint   RUNNING: checkpoints_asked + 1                 its trainer checkpoints
    rollback     see `services/dispatcher/rollback.py`
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.dispatcher import rollback
from shared.bus import names
from shared.bus.emit import emit
from shared.contracts import RunRecord, RunState, decode, encode
from shared.contracts.control import Command, Pause, Resume, Rollback, Steer, TakeCheckpoint
from shared.contracts.events import Paused, Reopened, Resumed, RunWarning
from shared.contracts.ledger import Hold
from shared.errors import ContractError, TransientError
from shared.ledger.holds import Estimate, Holds, reckon, shortfall
from shared.state import transitions
from shared.state.pools import Pools
from shared.state.runs import Change, Runs

if TYPE_CHECKING:
    from services.dispatcher.scheduler import Scheduler

log = logging.getLogger("baton.dispatcher")


class Steering:
    def __init__(self, nc: Client, runs: Runs, pools: Pools, holds: Holds) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.runs = runs
        self.pools = pools
        self.holds = holds
        self.scheduler: Scheduler | None = None
        """Told of every run queued again here (a resume, a reopening rollback): it admits
        them when their pool has room."""

    async def on_request(self, msg: Msg) -> None:
        req = decode(msg.data, Steer)
        if msg.subject != names.steer_subject(req.run_id):
            raise ContractError(f"run {req.run_id!r} differs from the subject's", "$.run_id")
        found = await self.runs.get(req.run_id)
        if found is None:
            raise ContractError(f"no run {req.run_id!r}", "$.run_id")
        record = found[0]
        if record.state.terminal and not isinstance(req, Rollback):
            raise ContractError(f"run {req.run_id} is {record.state.value}", "$.run_id")
        if isinstance(req, Pause):
            await self._pause(req)
        elif isinstance(req, Resume):
            await self._resume(req, record)
        elif isinstance(req, TakeCheckpoint):
            await self._checkpoint(req, record)
        else:
            await self._rollback(req, record)

    async def _change(self, req: Steer, change: Change) -> RunRecord:
        record = await self.runs.update(req.run_id, change)
        if record is None:
            found = await self.runs.get(req.run_id)
            state = found[0].state.value if found else "gone"
            raise ContractError(f"{req.action} does not apply to run {req.run_id} ({state})")
        log.info("%s: %s (%s)", req.run_id, req.action, req.reason or "no reason given")
        await self._wake(record, req.reason)
        return record

    async def _pause(self, req: Pause) -> None:
        """A running run's trainer checkpoints and stops it (and says so); a queued one is
        PAUSED here, its queued task deleted (a copy that escaped is acked on sight)."""
        record = await self._change(req, transitions.pause(req.reason or "paused by an operator"))
        if record.state is not RunState.PAUSED:
            return
        with contextlib.suppress(NotFoundError):
            queued = await self.js.get_last_msg(
                names.TASKS_STREAM, names.task_subject(record.spec.pool, req.run_id)
            )
            assert queued.seq is not None
            await self.js.delete_msg(names.TASKS_STREAM, queued.seq)
        paused = Paused(run_id=req.run_id, reason=record.pause_requested or "", step=record.step)
        await emit(self.js, paused, msg_id=f"paused.{req.run_id}.{record.dispatch}.queued")

    async def _resume(self, req: Resume, paused: RunRecord) -> None:
        """A paused run is queued again. One whose credits are held is checked PAUSED (and
        not settled) before anything is held — a resume delivered again, or asked twice,
        holds nothing — and then holds only what its holds no longer cover of the steps it
        still has to train (a balance short of that refuses the resume)."""
        if paused.state is not RunState.PAUSED or paused.settled:
            raise ContractError(
                f"resume does not apply to run {req.run_id} ({paused.state.value})", "$.run_id"
            )
        hold: transitions.Taken | None = None
        if paused.price and paused.owner:
            try:
                hold = await self._hold_again(paused)
            except ContractError as exc:
                refused = RunWarning(run_id=req.run_id, kind="resume_refused", detail=exc.reason)
                await emit(self.js, refused)
                raise
        record = await self._change(req, transitions.resume(hold, allow_changes=req.allow_changes))
        self._queued(record)
        resumed = Resumed(run_id=req.run_id, reason=req.reason or "resumed by an operator")
        await emit(self.js, resumed, msg_id=f"resumed.{req.run_id}.{record.dispatch}")

    async def _hold_again(self, r: RunRecord) -> transitions.Taken | None:
        """The hold the run needs to train its remaining steps — their estimate less what
        its life's holds still cover (`shortfall`) — taken in the ledger; None when its
        holds cover them."""
        steps = max(1, r.spec.total_steps - r.step)
        estimate = await self._estimate(r, steps)
        need = shortfall(estimate.amount, r.held, r.life_metered_s, r.price)
        if need <= 0:
            log.info("%s: its holds still cover %s; nothing more held", r.run_id, estimate.how)
            return None
        return await self._take(r, r.life, len(r.holds), need, estimate.how)

    async def _estimate(self, r: RunRecord, steps: int) -> Estimate:
        pool = (await self.pools.policy.current()).pool(r.spec.pool)
        priced = msgspec.structs.replace(pool, price=r.price)  # what it was accepted at
        return await reckon(self.pools, r.spec, priced, steps, own=(r.metered_s, r.step))

    async def _take(
        self, r: RunRecord, life: int, n: int, amount: int, how: str
    ) -> transitions.Taken:
        wanted = Hold(owner=r.owner, run_id=r.run_id, n=n, life=life, amount=amount, estimate=how)
        (stored,) = await self.holds.take(r.owner, [wanted])
        return transitions.Taken(life, n, stored)

    async def _reopen_hold(self, r: RunRecord, step: int) -> transitions.Taken | None:
        """For a priced FAILED run rolled back to `step`: the first hold of its next life,
        for the steps from `step` on, taken in the ledger once its life is settled (before
        that, the rollback waits: `TransientError`). None for a run without a price."""
        if not (r.price and r.owner):
            return None
        if not r.settled:
            raise TransientError(f"run {r.run_id}'s credits are still being settled", 1.0)
        estimate = await self._estimate(r, max(1, r.spec.total_steps - step))
        return await self._take(r, r.life + 1, 0, estimate.amount, estimate.how)

    def _queued(self, record: RunRecord) -> None:
        if self.scheduler is not None and record.state is RunState.QUEUED:
            self.scheduler.observe(record)

    async def _checkpoint(self, req: TakeCheckpoint, record: RunRecord) -> None:
        """One more checkpoint asked in the record: the attempt holding the run (a group's
        leader) has its training process write one at its next step boundary, as soon as
        the wake reaches its trainer or at its next renewal if the wake is lost, and the
        commit's `checkpoint_committed` event is the answer. Only a run in training has a
        process to ask."""
        if record.state != "RUNNING" or not record.worker:
            state = "between attempts" if record.state == "RUNNING" else record.state.value
            raise ContractError(
                f"run {req.run_id} is {state}: only a run in training can checkpoint", "$.run_id"
            )
        await self._change(req, transitions.ask_checkpoint)

    async def _rollback(self, req: Rollback, record: RunRecord) -> None:
        ordered = await rollback.order(self.runs, req, record, reopen=self._reopen_hold)
        if ordered.life > record.life:
            # Its next life begins: the event marks where its events begin (and the
            # last life's end), whatever reaches the stream after the last life's end.
            reopened = Reopened(
                run_id=req.run_id, life=ordered.life, step=req.step, reason=req.reason
            )
            await emit(self.js, reopened, msg_id=f"reopened.{req.run_id}.l{ordered.life}")
        self._queued(ordered)
        await self._wake(ordered, req.reason or "rolled back")

    async def _wake(self, record: RunRecord, reason: str) -> None:
        if record.worker:
            wake = Command(run_id=record.run_id, action="wake", reason=reason)
            await self.nc.publish(names.control_subject(record.worker), encode(wake))
