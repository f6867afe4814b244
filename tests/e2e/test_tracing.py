"""One real run, one trace: submit -> dispatch -> attempt -> commit -> checkpoint.commit.

Spans of separate processes would need a collector to meet, so the dispatcher, the
checkpointer and the trainer run here, in the test's process (the trainer still trains in a
real child process), all sending to the SDK's in-memory exporter and metric reader. The
trace context crosses NATS exactly as between processes: in message headers only. The
hub's server runs `baton up`'s authorization, and each service logs in as its own role.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from opentelemetry.sdk.metrics.export import HistogramDataPoint
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from baton.client import calls as client
from baton.stack.options import StackOptions, vault
from baton.stack.servers import hub
from services.checkpointer.service import Checkpointer
from services.dispatcher.service import Dispatcher
from services.trainer.service import Trainer
from shared import config
from shared.bus.connect import connect
from shared.bus.service import StopSignals
from shared.contracts import JobSpec, RunState, convert
from shared.contracts.events import Accepted
from shared.credentials import Vault, options_for
from tests.e2e.jobs import finished
from tests.support.audit import Audit
from tests.support.otel import metric_points, sinks
from tests.support.stack import eventually


class Services:
    """Dispatcher and checkpointer, and trainers started on demand, each on its own
    connection, all in this process."""

    def __init__(self, url: str, tmp_path: Path, vault: Vault) -> None:
        self.url = url
        self.vault = vault
        self.env = {
            "NATS_URL": url,
            "BATON_STORE": f"file://{tmp_path / 'store'}",
            "BATON_WORK_DIR": str(tmp_path / "work"),
            "BATON_PROGRESS_INTERVAL": "0.05",
        }
        self.stop = asyncio.Event()
        self.conns: list[Client] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.trainers: list[tuple[Trainer, StopSignals, asyncio.Task[None]]] = []

    async def _conn(self, role: str) -> Client:
        options = options_for(self.vault.get(role))
        name = f"{role}{len(self.conns)}"
        self.conns.append(await connect(self.url, name, first_attempt_timeout=5, options=options))
        return self.conns[-1]

    async def start(self) -> Client:
        settings = config.load(self.env)
        dispatcher = Dispatcher(await self._conn("dispatcher"), settings)
        self.checkpointer = Checkpointer(await self._conn("checkpointer"), settings)
        for service in (dispatcher, self.checkpointer):
            await service.start()
        self.tasks += [
            asyncio.create_task(dispatcher.serve(self.stop)),
            asyncio.create_task(self.checkpointer.serve(self.stop)),
        ]
        return await self._conn("operator")

    async def trainer(self, worker: str) -> tuple[Trainer, StopSignals, asyncio.Task[None]]:
        settings = config.load({**self.env, "BATON_WORKER_ID": worker})
        signals = StopSignals()
        trainer = Trainer(await self._conn("trainer"), settings, signals)
        await trainer.start()
        self.trainers.append((trainer, signals, asyncio.create_task(trainer.serve(signals.stop))))
        return self.trainers[-1]

    async def close(self) -> None:
        """Stop everything: afterwards every span has ended."""
        self.stop.set()
        for _, signals, _ in self.trainers:
            signals.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks, *(t for *_, t in self.trainers)), 60)
        await self.checkpointer.store.close()
        for nc in self.conns:
            with contextlib.suppress(Exception):
                await nc.close()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Services]:
    opts = StackOptions(data_dir=tmp_path / "hub", port=0)
    server, keys = hub(opts), vault(opts)
    assert keys is not None, "the stack runs with authorization, as `baton up` does"
    await server.start()
    try:
        s = Services(server.url, tmp_path, keys)
        try:
            yield s
        finally:
            await s.close()
    finally:
        await server.stop()
    Audit(tmp_path).check()


def job(total_steps: int, every: int) -> JobSpec:
    return convert(
        {
            "name": "traced",
            "entry_point": "examples.regression:train",
            "total_steps": total_steps,
            "checkpoint": {"every_steps": every},
            "config": {"hidden": 16, "batch": 16},
        },
        JobSpec,
    )


async def finished_spans(exporter: InMemorySpanExporter, attempts: int) -> list[ReadableSpan]:
    """The COMPLETED record is written inside the last attempt: its span ends a moment
    later, once the trainer has answered the task."""
    for _ in range(100):
        spans = list(exporter.get_finished_spans())
        if sum(s.name == "attempt" for s in spans) >= attempts:
            return spans
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {attempts} attempt spans: {[s.name for s in spans]}")


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def attr(span: ReadableSpan, key: str) -> Any:
    return (span.attributes or {}).get(key)


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_a_run_is_one_trace_with_linked_spans(stack: Services) -> None:
    exporter, reader = sinks()
    exporter.clear()
    nc = await stack.start()
    await stack.trainer("w-trace")
    run_id, answer = await client.submit(nc, job(30, 10), 10)
    assert isinstance(answer, Accepted), answer
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED, record
    spans = await finished_spans(exporter, 1)

    submit, dispatch, attempt = (one(spans, n) for n in ("submit", "dispatch", "attempt"))
    commits = [s for s in spans if s.name == "commit"]
    verified = [s for s in spans if s.name == "checkpoint.commit"]
    traced = [submit, dispatch, attempt, *commits, *verified]
    trace_ids = {s.context.trace_id for s in traced}
    assert len(trace_ids) == 1, trace_ids
    assert submit.parent is None, submit.parent

    assert parent_of(dispatch) == submit.context.span_id
    assert parent_of(attempt) == dispatch.context.span_id
    steps = sorted(attr(s, "baton.step") for s in commits)
    # Every 10 steps, but a periodic checkpoint due while the previous one is still being
    # written is postponed (baton/runtime/snapshot.py), so on a busy machine 20 may move or merge
    # into the final one.
    assert steps[0] == 10 and steps[-1] == 30 and len(set(steps)) == len(steps), steps
    assert all(parent_of(c) == attempt.context.span_id for c in commits)
    by_id = {c.context.span_id: c for c in commits}
    assert len(verified) == len(commits), [s.attributes for s in verified]
    for v in verified:
        # The checkpointer's span is the child of the trainer's `commit` span of that step.
        parent = by_id.get(parent_of(v) or 0)
        assert parent is not None, v.parent
        assert attr(v, "baton.step") == attr(parent, "baton.step")
        assert attr(v, "baton.outcome") == attr(parent, "baton.outcome") == "committed"

    assert attr(attempt, "baton.run_id") == run_id
    assert attr(attempt, "baton.worker") == "w-trace"
    assert attr(attempt, "baton.attempt") == 1
    assert attr(attempt, "baton.start_step") == 0
    assert attr(attempt, "baton.token") == record.token
    assert attr(attempt, "baton.outcome") == "completed"

    points = metric_points(reader)
    sizes = [
        p for p in points.get("baton.checkpoint.size", []) if isinstance(p, HistogramDataPoint)
    ]
    assert sizes and sum(p.count for p in sizes) >= len(steps), sizes
    assert all(p.sum > 0 for p in sizes), sizes
    assert "baton.commit.duration" in points and "baton.checkpoint.stall" in points, list(points)


async def test_a_preempted_run_stays_one_trace_and_records_its_recovery(stack: Services) -> None:
    exporter, reader = sinks()
    exporter.clear()
    nc = await stack.start()
    first, signals, serving = await stack.trainer("w-first")
    run_id, answer = await client.submit(nc, job(4000, 200), 10)
    assert isinstance(answer, Accepted), answer

    async def training() -> bool:
        return first.attempt is not None and first.attempt.step >= 200

    await eventually(training, 60, "the first attempt to pass step 200")
    signals.stop.set()  # SIGTERM, as far as the trainer can tell: checkpoint, release, nak(0)
    await asyncio.wait_for(serving, 60)
    await stack.trainer("w-second")
    record = await finished(nc, run_id, timeout=120)
    assert record.state is RunState.COMPLETED and record.attempts == 2, record

    spans = await finished_spans(exporter, 2)
    dispatch = one(spans, "dispatch")
    attempts = sorted(
        (s for s in spans if s.name == "attempt"),
        key=lambda s: attr(s, "baton.attempt"),
    )
    assert len({s.context.trace_id for s in spans}) == 1, "more than one trace"
    # The redelivered task carried the same headers: both attempts hang off one dispatch.
    assert [parent_of(a) for a in attempts] == [dispatch.context.span_id] * 2
    outcomes = [attr(a, "baton.outcome") for a in attempts]
    assert outcomes == ["preempted", "completed"], outcomes
    resumed = attr(attempts[1], "baton.start_step")
    assert isinstance(resumed, int) and resumed >= 200, resumed

    points = metric_points(reader)
    recovery = [p for p in points.get("baton.recovery.duration", []) if p.count]
    assert sum(p.count for p in recovery) >= 1 and all(p.sum > 0 for p in recovery), recovery
    redelivered = points.get("baton.task.redeliveries", [])
    assert sum(p.value for p in redelivered) >= 1, redelivered
