"""Following an attempt's commits: publish the requests, learn the outcomes.

Outcomes arrive as `checkpoint_committed` / `commit_refused` events on a core subscription.
A core subscription misses what is published while the link is down, so a waiter that
hears nothing asks the store, which is the truth anyway.

Each request is a `commit` span, from the publish until the trainer learns the outcome (the
event, the store, or the attempt ending first); its context rides in the request's headers,
so the checkpointer's `checkpoint.commit` span is its child.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.context import Context

from shared import telemetry
from shared.bus import names
from shared.bus.connect import publish
from shared.checkpoint import commit
from shared.checkpoint.store import Store
from shared.contracts import CommitRequest, decode, encode
from shared.contracts.child import CheckpointReady
from shared.contracts.events import CheckpointCommitted, CommitRefused, Event
from shared.errors import ContractError
from shared.state import transitions
from shared.state.runs import Runs

POLL_STORE_S = 2.0


class Commits:
    def __init__(
        self,
        js: JetStreamContext,
        store: Store,
        runs: Runs,
        run_id: str,
        worker: str,
        token: Callable[[], int],
        keep_last: int,
        pool: str = "",
        site: str = "",
        side: str = "",
        ranks: int = 1,
        elastic: bool = False,
        trained_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.js = js
        self.store = store
        self.runs = runs
        self.run_id = run_id
        self.worker = worker
        self._token = token
        self._keep_last = keep_last
        self._outcomes: dict[tuple[int, int], asyncio.Future[bool]] = {}
        self._pool = pool
        self._ranks = ranks
        self._elastic = elastic
        self._site = site
        """At a site, requests go to the site's checkpointer, whose events come back on
        the site's subjects."""
        self._side = side
        """Whose attempt commits ("" the hub's, wherever it trains; `CommitRequest.side`)."""
        self._trained_s = trained_s
        """Trainer-seconds the attempt trained so far (its meter's), booked with each commit."""
        self.trace_context: Context | None = None
        """The attempt's span, parent of every `commit` span."""
        self._spans: dict[tuple[int, int], tuple[trace.Span, float]] = {}
        self.newest: tuple[int, float] = (0, time.monotonic())
        """The step of this run's newest committed checkpoint and when (monotonic) the
        training process reached it: what a failure now would fall back to."""
        self._last: tuple[int, float] = self.newest
        """The newest step the training process reported, and when."""
        self._reached: dict[tuple[int, int], float] = {}
        """When each checkpoint awaiting its commit was reached."""
        self.on_committed: Callable[[int], None] = lambda step: None
        """Told the step of each of this attempt's checkpoints that commits, as it is heard
        of (the training process flushes the steps it keeps to the run's tracker)."""

    def resumed(self, step: int) -> None:
        """The attempt resumed from the committed checkpoint at `step`, reached now."""
        self.newest = (step, time.monotonic())

    def reached(self, step: int) -> None:
        """The training process reported `step` (every checkpoint's step is reported)."""
        self._last = (step, time.monotonic())

    async def request(self, ready: CheckpointReady) -> None:
        self._future(ready.token, ready.step)
        step, at = self._last
        self._reached[(ready.token, ready.step)] = at if step == ready.step else time.monotonic()
        req = CommitRequest(
            run_id=self.run_id,
            token=ready.token,
            step=ready.step,
            worker=self.worker,
            files=ready.files,
            final=ready.final,
            metrics=ready.metrics,
            digest=ready.digest,
            keep_last=self._keep_last,
            # An elastic group's size changes from one attempt to the next: the checkpoint
            # is of the ranks that wrote it (rank 0's alone unless objects are sharded).
            ranks=ready.ranks if self._elastic else self._ranks,
            sharded=ready.sharded,
            side=self._side,
        )
        span = telemetry.tracer.start_span(
            "commit",
            context=self.trace_context,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                telemetry.RUN_ID: self.run_id,
                telemetry.TOKEN: ready.token,
                telemetry.STEP: ready.step,
                "baton.final": ready.final,
                "baton.bytes": sum(f.size for f in ready.files),
            },
        )
        # Started before the publish: a publish retried through an outage is part of what
        # the commit costs. Monotonic, so a clock step never makes a negative latency.
        self._spans[(ready.token, ready.step)] = (span, time.monotonic())
        await publish(
            self.js,
            names.at_site(names.commit_subject(self.run_id), self._site),
            encode(req),
            msg_id=f"commit.{self.run_id}.{ready.token}.{ready.step}",
            headers=telemetry.inject(context=trace.set_span_in_context(span)),
        )

    async def on_event(self, msg: Msg) -> None:
        try:
            event: Event = decode(msg.data, Event)
        except ContractError:
            return
        if not isinstance(event, CheckpointCommitted | CommitRefused):
            return
        fut = self._outcomes.get((event.token, event.step))
        if fut is not None and not fut.done():
            fut.set_result(isinstance(event, CheckpointCommitted))
        if isinstance(event, CheckpointCommitted):
            self._end_span(event.token, event.step, "committed", measured=True)
        else:
            self._end_span(event.token, event.step, "refused", error=event.reason)
        if isinstance(event, CheckpointCommitted) and event.token == self._token():
            self.on_committed(event.step)
            at = self._reached.pop((event.token, event.step), None)
            if at is not None and event.step > self.newest[0]:
                self.newest = (event.step, at)
            advance = transitions.advance_step(self._token(), event.step, self._trained_s())
            await self.runs.update(self.run_id, advance)

    async def wait(self, token: int, step: int, timeout: float) -> bool:
        """True once the checkpoint (token, step) is committed; False if refused, if a
        higher token took over, or after `timeout` seconds."""
        fut = self._future(token, step)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = deadline - time.monotonic()
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(fut), min(POLL_STORE_S, left))
            with contextlib.suppress(Exception):  # the store may be down too; ask again
                latest = await commit.read_latest(self.store, self.run_id)
                if latest is not None:
                    p = latest[0]
                    if p.token == token and p.step >= step:
                        # Heard from the store, not the event: no latency sample, since
                        # the polling interval would be most of it.
                        self._end_span(token, step, "committed")
                        self.on_committed(step)
                        return True
                    if p.token > token:
                        self._end_span(token, step, "superseded")
                        return False
        return False

    def close(self) -> None:
        """The attempt is over: end the spans of commits whose outcome it never learned."""
        for token, step in list(self._spans):
            self._end_span(token, step, "unknown")

    def _end_span(
        self, token: int, step: int, outcome: str, *, measured: bool = False, error: str = ""
    ) -> None:
        found = self._spans.pop((token, step), None)
        if found is None:  # not ours, or ended already (a duplicate event)
            return
        span, began = found
        if measured:
            telemetry.COMMIT_LATENCY.record(time.monotonic() - began, {telemetry.POOL: self._pool})
        span.set_attribute(telemetry.OUTCOME, outcome)
        if error:
            span.set_status(trace.StatusCode.ERROR, error)
        span.end()

    def _future(self, token: int, step: int) -> asyncio.Future[bool]:
        key = (token, step)
        if key not in self._outcomes:
            self._outcomes[key] = asyncio.get_running_loop().create_future()
        return self._outcomes[key]
