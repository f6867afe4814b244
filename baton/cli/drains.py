"""What `baton drain`, `baton undrain` and `baton checkpoint` do over NATS, apart from how
they print (`baton/cli/operate.py`).

Invariant: each command writes the order where it is kept — a drain is the worker's key in
`baton_drains`, a checkpoint request a `TakeCheckpoint` on the run's steer subject — and only
then wakes or waits; the waits read what the trainer publishes (its heartbeat, the run's
`checkpoint_committed` events) and never decide anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from baton.client import calls as client
from baton.client import reader
from baton.client.errors import CliError, needs
from shared.bus import names
from shared.contracts import RunState, decode, encode
from shared.contracts.control import Command, Drain, TakeCheckpoint, WorkerInfo
from shared.contracts.events import CheckpointCommitted, Event, Preempted
from shared.errors import ContractError
from shared.state.drains import Drains, check_worker

POLL_S = 0.2
"""How often a wait reads the worker's heartbeat (the trainer publishes a change at once)."""


class Drained(msgspec.Struct, frozen=True, kw_only=True):
    """What `baton drain` saw: the worker's heartbeat before and after, and the run it was
    running when drained — handed over at `step` (its `preempted` event), or ended."""

    worker: str
    live: bool
    """A trainer of that name heartbeats; a drain of one that does not waits for its start."""
    idle: bool
    """Its heartbeat says drained, and no run: it holds nothing any more."""
    run_id: str | None = None
    rank: int | None = None
    step: int | None = None
    """The step its run was handed over at (the checkpoint the next attempt resumes from)."""
    ended: str | None = None
    """The run's state, when it ended instead of being handed over."""


def _worker(name: str) -> str:
    try:
        return check_worker(name)
    except ContractError as exc:
        raise CliError(str(exc), 2) from None


async def heartbeat(nc: Client, worker: str) -> WorkerInfo | None:
    """The worker's newest heartbeat, None if it has none (not running, or dead)."""
    with needs("workers bucket"):
        kv = await nc.jetstream().key_value(names.WORKERS_BUCKET)
        try:
            entry = await kv.get(worker)
        except KeyNotFoundError:
            return None
    return decode(entry.value, WorkerInfo) if entry.value else None


async def _wake(nc: Client, worker: str, reason: str) -> None:
    """Tell the trainer to read its drain key now (it reads it every heartbeat anyway)."""
    wake = Command(run_id="", action="wake", reason=reason)
    await nc.publish(names.control_subject(worker), encode(wake))
    await nc.flush()


async def drain(nc: Client, worker: str, reason: str, wait_s: float) -> Drained:
    """Drain `worker`, then wait up to `wait_s` until its heartbeat says it is drained and
    holds nothing, and say what became of the run it held: the run's `preempted` events are
    read from before the drain, so the one that follows it is told apart by its place in
    the stream, not by any clock."""
    worker = _worker(worker)
    before = await heartbeat(nc, worker)
    handovers = None
    if before is not None and before.run_id is not None:
        subject = names.event_subject(before.run_id, "preempted")
        handovers = await reader.read(nc, names.EVENTS_STREAM, subject)
    try:
        if handovers is not None:
            await reader.drain(handovers, idle_s=0.5)  # those before the drain
        with needs("drains bucket"):
            await Drains(nc.jetstream()).drain(Drain(worker=worker, reason=reason, at=time.time()))
        await _wake(nc, worker, reason or "drained")
        if before is None:
            return Drained(worker=worker, live=False, idle=False)
        after = before
        deadline = asyncio.get_running_loop().time() + wait_s
        while wait_s > 0:
            now = await heartbeat(nc, worker)
            if now is None or (now.drained and now.run_id is None):
                # Drained and idle — or its trainer died or stopped: it holds nothing.
                return await _outcome(nc, before, handovers, live=now is not None)
            after = now
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        return Drained(
            worker=worker, live=True, idle=False, run_id=after.run_id, rank=after.rank,
            step=after.step,
        )  # fmt: skip
    finally:
        if handovers is not None:
            await handovers.unsubscribe()


async def _outcome(
    nc: Client, before: WorkerInfo, handovers: reader.StreamReader | None, *, live: bool
) -> Drained:
    """What became of the run `before` shows the worker running: the step of its first
    `preempted` event since the drain (by this worker, or by its group's leader for a rank
    it held), or the state it ended in."""
    run_id = before.run_id
    if run_id is None or handovers is None:
        return Drained(worker=before.worker, live=live, idle=True)
    found = await client.record(nc, run_id)
    step: int | None = None
    if not found.state.terminal:
        with contextlib.suppress(TimeoutError):  # stored before the heartbeat said idle
            step = decode((await handovers.next_msg(timeout=2.0)).data, Preempted).step
    return Drained(
        worker=before.worker, live=live, idle=True, run_id=run_id, rank=before.rank, step=step,
        ended=found.state.value if found.state.terminal else None,
    )  # fmt: skip


async def undrain(nc: Client, worker: str) -> bool:
    """Let `worker` take work again; whether it was drained."""
    worker = _worker(worker)
    with needs("drains bucket"):
        was = await Drains(nc.jetstream()).undrain(worker)
    await _wake(nc, worker, "undrained")
    return was


async def drained_workers(nc: Client, workers: list[str]) -> dict[str, Drain]:
    """Which of `workers` are drained (their drain records)."""
    drains = Drains(nc.jetstream())
    out = {}
    with needs("drains bucket"):
        for w in workers:
            with contextlib.suppress(ContractError):  # a name that cannot be a key
                if (d := await drains.get(w)) is not None:
                    out[w] = d
    return out


def _committed(msg: Any) -> CheckpointCommitted | None:
    event: Event = decode(msg.data, Event)
    return event if isinstance(event, CheckpointCommitted) else None


async def checkpoint(nc: Client, run_id: str, reason: str, wait_s: float) -> dict[str, Any]:
    """Ask the run's trainer for a checkpoint now, and wait up to `wait_s` for the run's
    next `checkpoint_committed` (a commit the job's own cadence makes meanwhile counts: it
    too holds the state at or after the request)."""
    found = await client.record(nc, run_id)
    if found.state is not RunState.RUNNING or not found.worker:
        state = "between attempts" if found.state is RunState.RUNNING else found.state.value
        raise CliError(f"run {run_id} is {state}: only a run in training can checkpoint", 2)
    sub = await reader.read(
        nc, names.EVENTS_STREAM, names.event_subject(run_id, "checkpoint_committed")
    )
    try:
        await reader.drain(sub, idle_s=0.5)  # the commits so far: the answer comes after
        await client.steer(nc, TakeCheckpoint(run_id=run_id, reason=reason))
        committed = await reader.first(sub, wait_s, _committed)
        step = None if committed is None else committed.step
        return {"run_id": run_id, "worker": found.worker, "step": step}
    finally:
        await sub.unsubscribe()
