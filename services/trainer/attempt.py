"""One training attempt: a lease held, a child process running, its commits followed.

An attempt ends in exactly one outcome; only the trainer's loop turns it into an answer to
the task message:

    COMPLETED  final checkpoint committed, run record COMPLETED      -> ack
    PREEMPTED  stopped on SIGTERM, checkpoint committed, lease freed  -> nak(0): next worker now
    RETRY      user code failed, retries left                         -> nak(back-off)
    FAILED     user code failed for good, run record FAILED           -> ack
    FENCED     someone else holds the run now                         -> nothing: the message is
               no longer ours, and a late ack could delete the new holder's copy (NATS-NOTES)
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.trainer.child_proc import Child
from shared import commit, names
from shared.config import Settings
from shared.connect import publish
from shared.contracts import CommitRequest, RunRecord, RunState, Task, decode, encode
from shared.contracts.child import (
    CheckpointReady,
    Control,
    Finished,
    Launch,
    Restored,
    StepDone,
)
from shared.contracts.events import (
    AttemptFailed,
    CheckpointCommitted,
    CommitRefused,
    Completed,
    Event,
    Failed,
    Fenced,
    Preempted,
    Progress,
    Started,
)
from shared.contracts.events import Restored as RestoredEvent
from shared.errors import ContractError
from shared.events import emit
from shared.lease import Lease
from shared.runs import Runs
from shared.store import Store

log = logging.getLogger("baton.trainer")

FINAL_COMMIT_WAIT_S = 900.0
POLL_STORE_S = 2.0
LOG_TAIL_BYTES = 3000
EXIT_BAD_LAUNCH = 2


class Outcome(enum.Enum):
    COMPLETED = "completed"
    PREEMPTED = "preempted"
    RETRY = "retry"
    FAILED = "failed"
    FENCED = "fenced"


class Attempt:
    def __init__(
        self,
        nc: Client,
        settings: Settings,
        store: Store,
        runs: Runs,
        task: Task,
        lease: Lease,
        child: Child,
        stop: asyncio.Event,
        hurry: asyncio.Event,
        beat_now: asyncio.Event,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.store = store
        self.runs = runs
        self.task = task
        self.run_id = task.run_id
        self.lease = lease
        self.child = child
        self.stop = stop
        self.hurry = hurry
        self.beat_now = beat_now
        self.worker = settings.worker_id
        self.fenced = asyncio.Event()
        self.fence_reason = ""
        self.step = 0
        self.committed: dict[tuple[int, int], asyncio.Future[bool]] = {}
        self.retry_delay = 0.0
        self.log_path = Path(settings.work_dir) / "logs" / f"{self.run_id}.log"
        self.last_checkpoint: CheckpointReady | None = None
        self._last_progress = 0.0
        self._rate: tuple[float, int] | None = None

    async def run(self, touch: Callable[[], Awaitable[None]]) -> Outcome:
        token = self.lease.token
        record = await self.runs.update(self.run_id, self._mark_running)
        if record is None:
            return Outcome.FENCED
        latest = await commit.read_latest(self.store, self.run_id)
        self.step = latest[0].step if latest else 0
        await emit(
            self.js,
            Started(
                run_id=self.run_id,
                worker=self.worker,
                token=token,
                attempt=record.attempts,
                start_step=self.step,
            ),
        )
        log.info(
            "%s: attempt %d from step %d, token %d", self.run_id, record.attempts, self.step, token
        )
        sub = await self.nc.subscribe(names.events_of_run(self.run_id), cb=self._on_event)
        self.child.send(
            Launch(task=self.task, token=token, worker=self.worker, store_url=self.store.url)
        )
        background = [
            asyncio.create_task(self.child.copy_output(self.log_path)),
            asyncio.create_task(self._keep(touch)),
        ]
        try:
            return await self._follow()
        finally:
            self.child.kill()
            await self.child.wait()
            for t in background:
                t.cancel()
            await sub.unsubscribe()

    # -- the attempt's course ------------------------------------------------------------

    async def _follow(self) -> Outcome:
        reader = asyncio.create_task(self._read())
        fenced = asyncio.create_task(self.fenced.wait())
        stopping = asyncio.create_task(self.stop.wait())
        try:
            await asyncio.wait({reader, fenced, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not reader.done() and not self.fenced.is_set() and self.stop.is_set():
                log.info("%s: preempted at step %d; checkpointing", self.run_id, self.step)
                self.child.send(Control(action="stop"))
                hurry = asyncio.create_task(self.hurry.wait())
                await asyncio.wait(
                    {reader, fenced, hurry},
                    timeout=self.settings.grace_s,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                hurry.cancel()
            if self.fenced.is_set():
                return await self._on_fenced()
            if not reader.done():  # grace ran out, or a second signal
                self.child.kill()
                return await self._on_preempted(None)
            finished = reader.result()
            code = await self.child.wait()
            if finished is None or code != 0:
                return await self._on_child_failed(code)
            if finished.stopped:
                return await self._on_preempted(finished)
            return await self._on_finished(finished)
        finally:
            for t in (reader, fenced, stopping):
                t.cancel()

    async def _read(self) -> Finished | None:
        async for msg in self.child.messages():
            if isinstance(msg, Restored):
                self.step = msg.step
                event = RestoredEvent(
                    run_id=self.run_id, worker=self.worker, step=msg.step, damaged=msg.damaged
                )
                await emit(self.js, event)
            elif isinstance(msg, StepDone):
                self.step = msg.step
                await self._progress(msg)
            elif isinstance(msg, CheckpointReady):
                await self._request_commit(msg)
                self.last_checkpoint = msg
            elif isinstance(msg, Finished):
                return msg
        return None

    async def _on_finished(self, finished: Finished) -> Outcome:
        final = self.last_checkpoint
        if final is None or not final.final:
            return await self._on_child_failed(0)
        ok = await self._committed(final.token, final.step, FINAL_COMMIT_WAIT_S)
        if not ok:
            self.fence_reason = f"final commit at step {final.step} was refused"
            return await self._on_fenced()

        def complete(r: RunRecord) -> RunRecord | None:
            if r.state.terminal or r.token != self.lease.token:
                return None
            return msgspec.structs.replace(
                r,
                state=RunState.COMPLETED,
                step=final.step,
                digest=final.digest,
                metrics=final.metrics,
                worker=None,
                reason=None,
            )

        if await self.runs.update(self.run_id, complete) is None:
            self.fence_reason = "the run record moved on"
            return await self._on_fenced()
        await emit(
            self.js,
            Completed(
                run_id=self.run_id, step=final.step, digest=final.digest, metrics=final.metrics
            ),
            msg_id=f"completed.{self.run_id}",
        )
        log.info("%s: completed at step %d, digest %s", self.run_id, final.step, final.digest[:16])
        return Outcome.COMPLETED

    async def _on_preempted(self, finished: Finished | None) -> Outcome:
        last = self.last_checkpoint
        if finished is not None and last is not None:
            await self._committed(last.token, last.step, self.settings.grace_s)
        await self.lease.release()
        step = last.step if last else 0
        await emit(self.js, Preempted(run_id=self.run_id, worker=self.worker, step=step))
        log.info("%s: preempted; lease released after step %d", self.run_id, step)
        return Outcome.PREEMPTED

    async def _on_fenced(self) -> Outcome:
        self.child.kill()
        reason = self.fence_reason or "lease lost"
        log.warning("%s: fenced (%s); training process killed", self.run_id, reason)
        await emit(
            self.js,
            Fenced(run_id=self.run_id, worker=self.worker, token=self.lease.token, reason=reason),
        )
        return Outcome.FENCED

    async def _on_child_failed(self, code: int) -> Outcome:
        tail = _tail(self.log_path)
        reason = (
            "the entry point could not be loaded"
            if code == EXIT_BAD_LAUNCH
            else f"training process exited with code {code}"
        )
        token = self.lease.token

        def count(r: RunRecord) -> RunRecord | None:
            if r.state.terminal or r.token != token:
                return None
            retries = r.retries + 1
            give_up = code == EXIT_BAD_LAUNCH or retries > r.spec.limits.max_retries
            return msgspec.structs.replace(
                r,
                retries=retries,
                state=RunState.FAILED if give_up else r.state,
                reason=reason if give_up else r.reason,
            )

        record = await self.runs.update(self.run_id, count)
        if record is None:
            return await self._on_fenced()
        if record.state is RunState.FAILED:
            await emit(
                self.js,
                Failed(run_id=self.run_id, reason=reason, detail=tail),
                msg_id=f"failed.{self.run_id}",
            )
            return Outcome.FAILED
        await emit(
            self.js,
            AttemptFailed(
                run_id=self.run_id,
                worker=self.worker,
                attempt=record.attempts,
                reason=reason,
                detail=tail,
            ),
        )
        await self.lease.release()
        self.retry_delay = min(2.0**record.retries, 60.0)
        return Outcome.RETRY

    # -- helpers -------------------------------------------------------------------------

    def _mark_running(self, r: RunRecord) -> RunRecord | None:
        if r.state.terminal or (r.token or 0) > self.lease.token:
            return None
        return msgspec.structs.replace(
            r,
            state=RunState.RUNNING,
            worker=self.worker,
            token=self.lease.token,
            attempts=r.attempts + 1,
        )

    async def _keep(self, touch: Callable[[], Awaitable[None]]) -> None:
        """Renew the lease and keep the task message ours, every third of the TTL and
        right after a reconnect. Losing the lease to someone else means fenced."""
        interval = self.lease.ttl_s / 3
        while not self.fenced.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.beat_now.wait(), interval)
            self.beat_now.clear()
            try:
                await touch()
                if await self.lease.renew():
                    continue
                old = self.lease.token
                if await self.lease.acquire() and await self._still_ours(old):
                    log.warning(
                        "%s: lease lapsed and was re-taken; token %d -> %d",
                        self.run_id,
                        old,
                        self.lease.token,
                    )
                    self.child.send(Control(action="token", token=self.lease.token))
                    await self.runs.update(self.run_id, self._retoken(old))
                    continue
                self.fence_reason = "the lease was taken over by another worker"
                self.fenced.set()
            except Exception as exc:  # a link that is down: keep training, try again
                log.warning(
                    "%s: lease renewal failed (%s); training goes on",
                    self.run_id,
                    type(exc).__name__,
                )

    def _retoken(self, old: int) -> Callable[[RunRecord], RunRecord | None]:
        def change(r: RunRecord) -> RunRecord | None:
            if r.state.terminal or r.token != old:
                return None
            return msgspec.structs.replace(r, token=self.lease.token)

        return change

    async def _still_ours(self, old_token: int) -> bool:
        """After re-taking a lapsed lease: nobody else may have committed or moved the
        record in between, or continuing would rewind their work."""
        latest = await commit.read_latest(self.store, self.run_id)
        found = await self.runs.get(self.run_id)
        if (latest and latest[0].token > old_token) or found is None:
            await self.lease.release()
            return False
        record = found[0]
        if record.state.terminal or (record.token or 0) > old_token:
            await self.lease.release()
            return False
        return True

    async def _progress(self, msg: StepDone) -> None:
        now = time.monotonic()
        if self._rate is None:
            self._rate = (now, msg.step)
        if (
            now - self._last_progress < self.settings.progress_interval_s
            and msg.step < self.task.spec.total_steps
        ):
            return
        t0, s0 = self._rate
        rate = (msg.step - s0) / (now - t0) if now > t0 else 0.0
        self._last_progress = now
        event = Progress(
            run_id=self.run_id,
            step=msg.step,
            total_steps=self.task.spec.total_steps,
            metrics=msg.metrics,
            steps_per_s=rate,
            worker=self.worker,
        )
        # Progress is best-effort: while a link is down the next one will do.
        with contextlib.suppress(Exception):
            await emit(self.js, event, attempts=1)

    async def _request_commit(self, ready: CheckpointReady) -> None:
        self.committed.setdefault(
            (ready.token, ready.step), asyncio.get_running_loop().create_future()
        )
        req = CommitRequest(
            run_id=self.run_id,
            token=ready.token,
            step=ready.step,
            worker=self.worker,
            files=ready.files,
            final=ready.final,
            metrics=ready.metrics,
            digest=ready.digest,
        )
        await publish(
            self.js,
            names.commit_subject(self.run_id),
            encode(req),
            msg_id=f"commit.{self.run_id}.{ready.token}.{ready.step}",
        )

    async def _on_event(self, msg: Msg) -> None:
        try:
            event: Event = decode(msg.data, Event)  # type: ignore[arg-type]
        except ContractError:
            return
        if isinstance(event, CheckpointCommitted | CommitRefused):
            fut = self.committed.get((event.token, event.step))
            if fut is not None and not fut.done():
                fut.set_result(isinstance(event, CheckpointCommitted))
            if isinstance(event, CheckpointCommitted) and event.token == self.lease.token:
                step = event.step
                await self.runs.update(
                    self.run_id,
                    lambda r: (
                        msgspec.structs.replace(r, step=step)
                        if r.token == self.lease.token and r.step < step and not r.state.terminal
                        else None
                    ),
                )

    async def _committed(self, token: int, step: int, timeout: float) -> bool:
        """Wait for a commit's outcome: from its event, or — should the event be missed
        while a link was down — from the store itself, which is the truth."""
        fut = self.committed.setdefault((token, step), asyncio.get_running_loop().create_future())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), POLL_STORE_S)
            except TimeoutError:
                pass
            with contextlib.suppress(Exception):
                latest = await commit.read_latest(self.store, self.run_id)
                if latest is not None:
                    p = latest[0]
                    if p.token == token and p.step >= step:
                        return True
                    if p.token > token:
                        return False
        return False


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
