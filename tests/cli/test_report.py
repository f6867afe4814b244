"""`baton report`: the rendering over a synthetic history, and `collect` on a real server."""

from __future__ import annotations

import base64
import math
import re
import time
from pathlib import Path

import matplotlib.image
import pytest

from baton.cli.report import attempts_of, collect, render
from baton.client.errors import CliError
from baton.stack.natsserver import NatsServer
from shared.bus import streams
from shared.bus.connect import connect
from shared.bus.emit import emit
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import (
    Accepted,
    CheckpointCommitted,
    Completed,
    Diverged,
    Event,
    Preempted,
    Progress,
    Redispatched,
    Resized,
    Restored,
    RunWarning,
    Started,
)

RUN = "r0123456789abcdef0123"
DIGEST = "3fa9c1e2" + "0" * 56
SCRIPT = "<script>alert('x')</script>"


def history(t0: float = 1_700_000_000.0) -> list[Event]:
    """w1 trains from 0 and is SIGKILLed at step 47; the reaper notices; w2 takes over from
    the commit at 40 once the lease lapsed, is preempted at 80; w1 completes at 120."""
    events: list[Event] = []
    t = t0

    def add(event_type: type, dt: float = 0.0, **kw: object) -> None:
        nonlocal t
        t += dt
        events.append(event_type(run_id=RUN, at=t, **kw))

    def train(worker: str, token: int, first: int, last: int) -> None:
        for step in range(first + 1, last + 1):
            loss = 2.5 * math.exp(-step / 45) + 0.05 + 0.03 * math.sin(step)
            add(Progress, 0.25, step=step, total_steps=120, metrics={"loss": loss}, worker=worker)
            if step % 20 == 0:
                add(CheckpointCommitted, 0.05, step=step, token=token,
                    manifest=f"runs/{RUN}/manifests/{step}-{token}.json", bytes=4096,
                    final=step == 120)  # fmt: skip

    add(Accepted, name="mnist-mlp", pool="default", total_steps=120)
    add(Started, 0.8, worker="w1", token=1, attempt=1, start_step=0)
    add(Restored, 0.3, worker="w1", step=0)
    train("w1", 1, 0, 47)
    add(RunWarning, 3.0, kind="stalled", detail="no progress on w1 for 3s")
    add(Redispatched, 4.0, dispatch=2, reason=f"lost run {SCRIPT}")
    add(Started, 9.0, worker="w2", token=5, attempt=2, start_step=40)
    add(Restored, 0.4, worker="w2", step=40)
    add(Diverged, 0.3, worker="w2", checkpoint=40, step=42, metric="loss",
        expected="0.5123", got="0.5124")  # fmt: skip
    train("w2", 5, 40, 80)
    add(Preempted, 0.2, worker="w2", step=80)
    add(Started, 1.5, worker="w1", token=9, attempt=3, start_step=80)
    add(Resized, 0.1, worker="w1", epoch=9, from_ranks=2, to_ranks=1, step=80,
        reason="1 of at most 2 ranks held: no spare trainer was free")  # fmt: skip
    add(Restored, 0.3, worker="w1", step=80)
    train("w1", 9, 80, 120)
    add(Completed, 0.1, step=120, digest=DIGEST, metrics={"loss": 0.07})
    return events


def record(events: list[Event]) -> RunRecord:
    spec = JobSpec(name="mnist-mlp", entry_point="examples.mnist:train", total_steps=120)
    return RunRecord(
        run_id=RUN, spec=spec, spec_hash="h" * 64, state=RunState.COMPLETED,
        created_at=events[0].at, updated_at=events[-1].at, attempts=3, worker="w1",
        token=9, step=120, digest=DIGEST, metrics={"loss": 0.07},
    )  # fmt: skip


def test_attempts_are_split_by_what_ended_them() -> None:
    attempts = attempts_of(history())
    got = [(a.started.worker, a.outcome, a.first_step, a.last_step) for a in attempts]
    assert got == [
        ("w1", "died", 0, 47), ("w2", "preempted", 40, 80), ("w1", "completed", 80, 120)
    ], got  # fmt: skip
    died = attempts[0]
    assert died.alive_until < died.end_at, "a dead trainer's bar ends where it went silent"
    assert [c.step for c in attempts[1].commits] == [60, 80]


def test_render_writes_a_png_and_a_self_contained_escaped_page(tmp_path: Path) -> None:
    events = history()
    png, page = render(record(events), events, tmp_path / "out")
    assert (png.name, page.name) == (f"{RUN}.png", f"{RUN}.html")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    shape = matplotlib.image.imread(str(png)).shape
    assert shape[:2] == (900, 1400), shape
    text = page.read_text(encoding="utf-8")
    assert RUN in text and "mnist-mlp" in text
    for worker in ("w1", "w2"):
        assert f"<td>{worker}</td>" in text, worker
    assert SCRIPT not in text, "user text must be escaped"
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    embedded = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert embedded is not None
    assert base64.b64decode(embedded.group(1)) == data
    assert "<td>progress</td>" not in text, "progress events stay out of the table"
    assert '<tr class="diverged">' in text and "0.5124" in text, "the divergence is shown"
    assert '<tr class="resized">' in text and "to_ranks=1" in text, "the resize is shown"
    assert DIGEST in text


def test_render_copes_with_a_run_that_never_started(tmp_path: Path) -> None:
    events: list[Event] = [Accepted(run_id=RUN, at=1.0, name="x", pool="p", total_steps=5)]
    rec = RunRecord(
        run_id=RUN, spec=JobSpec(name="x", entry_point="m:f", total_steps=5),
        spec_hash="h", created_at=1.0, updated_at=1.0,
    )  # fmt: skip
    png, page = render(rec, events, tmp_path)
    assert png.stat().st_size > 0 and "accepted" in page.read_text(encoding="utf-8")


async def test_collect_reads_the_stored_history_in_order(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, "test", first_attempt_timeout=5)
    try:
        js = nc.jetstream()
        await streams.ensure(js)
        sent = history(time.time())[:12]
        for event in sent:
            await emit(js, event)
        other = Accepted(run_id="rother", name="o", pool="p", total_steps=1)
        await emit(js, other)
        began = time.monotonic()
        got = await collect(nc, RUN, idle_s=5.0)
        assert got == sent, [type(e).__name__ for e in got]
        assert time.monotonic() - began < 2.0, "a caught-up consumer stops without idling"
        assert await collect(nc, "rnothing", idle_s=0.2) == []
    finally:
        await nc.close()


async def test_collect_names_a_missing_event_stream(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, "test", first_attempt_timeout=5)
    try:
        with pytest.raises(CliError, match="does not exist"):
            await collect(nc, RUN, idle_s=0.2)
    finally:
        await nc.close()
