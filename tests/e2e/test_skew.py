"""Skewed clocks are harmless: a site whose services run 5 minutes ahead and a hub trainer 5
minutes behind, under libfaketime, through a cut of the site's link and a hand-over.

Leases expire on the hub server's clock, and every other time Baton decides on is a
difference of one clock's readings (docs/architecture.md, "Clocks"): so the run completes
bit for bit, its lease lapses once (the cut's doing), no stall or timeout fires early, it
retires no sooner than `BATON_GC_AGE` after its last write on the server's clock, and its
goodput and the trainers' ages hold no phantom 5 minutes.

libfaketime (Debian package `faketime`) shifts what `time.time()` reads in a process that
preloads it. `FAKETIME_DONT_FAKE_MONOTONIC` keeps the monotonic clock true, as a real host's
skewed wall clock leaves it. nats-server is a static Go binary: it reads the clock without
libc, so libfaketime cannot skew it (checked below) — the servers' clocks stay true here,
and only the hosts running Baton's services are skewed. The training processes pace their
steps with `Event.wait` (`tests.support.workloads:paced`: libfaketime 0.9.10 breaks
`time.sleep`).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from baton.client import calls as client
from baton.client import reader
from baton.stack.natsserver import NatsServer
from shared.bus import names
from shared.bus.connect import connect
from shared.checkpoint import retention
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunState, decode
from shared.contracts.events import (
    Completed,
    Event,
    Fenced,
    HandedOver,
    Progress,
    Redispatched,
    RunWarning,
    Started,
)
from shared.history.goodput import goodput
from shared.state import archive
from shared.state.runs import Runs
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

LIBFAKETIME = next(
    (
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/faketime/libfaketime.so.1"),
        )
        if p.exists()
    ),
    None,
)
pytestmark = pytest.mark.skipif(
    LIBFAKETIME is None,
    reason="libfaketime is not installed (Debian: apt-get install -y faketime); it skews the "
    "clocks of this test's services",
)

SKEW_S = 300.0
TTL = 6
GC_AGE = 15
EDGE = "lab1-trainer-1"
HUB_TRAINER = "hub-trainer-1"


def skewed(offset: str) -> dict[str, str]:
    """The environment that runs a process (and every process it forks) `offset` off."""
    assert LIBFAKETIME is not None
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


AHEAD, BEHIND = skewed("+5m"), skewed("-5m")


async def clocks_of(env: dict[str, str]) -> tuple[float, float]:
    """(wall − ours, monotonic − ours) of a Python child run with `env`."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; print(time.time(), time.monotonic())",
        env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    wall, mono = (float(x) for x in out.split())
    return wall - time.time(), mono - time.monotonic()


async def test_libfaketime_skews_python_but_not_nats_server(tmp_path: Path) -> None:
    wall, mono = await clocks_of({**os.environ, **AHEAD})
    assert wall == pytest.approx(SKEW_S, abs=30), "libfaketime must shift time.time()"
    assert abs(mono) < 30, "and leave the monotonic clock alone"
    wall, _ = await clocks_of({**os.environ, **BEHIND})
    assert wall == pytest.approx(-SKEW_S, abs=30)
    # A nats-server started with the same environment still stamps true time.
    saved = {k: os.environ.get(k) for k in AHEAD}
    os.environ.update(AHEAD)
    server = NatsServer(tmp_path / "nats", port=0)
    try:
        await server.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        nc = await connect(server.url, "probe", first_attempt_timeout=5)
        try:
            js = nc.jetstream()
            await js.add_stream(name="PROBE", subjects=["probe"])
            await js.publish("probe", b"x")
            msg = await js.get_msg("PROBE", seq=1)
            assert msg.time is not None
            assert abs(msg.time.timestamp() - time.time()) < 30, "nats-server is not skewed"
        finally:
            await nc.close()
    finally:
        await server.stop()


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Stack]:
    # Grants off: the run is held by the hub, so the cut lapses its lease and the hand-over
    # between the skewed hosts is the hub's (a granted run's `lost_after` is on the hub
    # server's clock too).
    env = {"BATON_GC_AGE": str(GC_AGE), "BATON_DELEGATE_AHEAD": "0"}
    s = Stack(tmp_path / "hub", trainers=0, lease_ttl=TTL, env=env)
    await s.start(("dispatcher", "checkpointer", "reaper"))
    try:
        yield s
    finally:
        await s.stop()


def paced(total: int, pace: float, **over: object) -> JobSpec:
    return job(
        entry_point="tests.support.workloads:paced", total_steps=total, seed=11,
        checkpoint={"every_steps": 10, "keep_last": 3}, config={"pace": pace}, **over,
    )  # fmt: skip


async def stored(nc: Client, run_id: str) -> list[tuple[Event, float]]:
    """The run's events as stored, each with the hub server's stamp."""
    sub = await reader.read(nc, names.EVENTS_STREAM, names.events_of_run(run_id))
    try:
        msgs = await reader.drain(sub)
    finally:
        await sub.unsubscribe()
    return [(decode(m.data, Event), m.metadata.timestamp.timestamp()) for m in msgs]


async def test_a_run_through_a_cut_and_a_hand_over_between_skewed_hosts(hub: Stack) -> None:
    site = Site(hub, "lab1")
    site.opts = msgspec.structs.replace(
        site.opts, extra_env={**site.opts.extra_env, **AHEAD}
    )  # its checkpointer and trainer (and their training processes) 5 minutes ahead
    await site.start(trainers=1)
    nc = await hub.client()
    limits = {"soft_timeout_s": 240, "hard_timeout_s": 600, "stall_timeout_s": 30}
    spec = paced(300, 0.06, limits=limits)
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    first = await log.wait_for(lambda e: isinstance(e, Started), 30, "start at the edge")
    assert isinstance(first, Started) and first.worker == EDGE
    await log.wait_for(lambda e: isinstance(e, Progress) and e.step >= 20, 30, "step 20")
    await hub.add_trainer(HUB_TRAINER, env=BEHIND)  # 5 minutes behind
    await eventually(lambda: _heard(nc, HUB_TRAINER), 30, "the hub trainer's heartbeat")
    # Three clocks ten minutes apart: nothing has lapsed, been handed over or fenced.
    assert not log.of(HandedOver) and not log.of(Fenced)

    site.proxy.sever()
    takeover = await log.wait_for(
        lambda e: isinstance(e, Started) and e.worker == HUB_TRAINER, 4 * TTL, "takeover"
    )
    assert isinstance(takeover, Started) and takeover.token > first.token
    site.proxy.restore()
    fenced = await log.wait_for(
        lambda e: isinstance(e, Fenced) and e.worker == EDGE, 6 * TTL, "the edge fenced"
    )
    assert isinstance(fenced, Fenced) and fenced.token == first.token
    record = await finished(nc, run_id, timeout=90)
    await log.wait_for(lambda e: isinstance(e, Completed), 20, "completed at the hub")
    assert record.state is RunState.COMPLETED, record

    # The uninterrupted reference, on whichever skewed trainer takes it (while we wait).
    reference = await submit(nc, paced(300, 0.0))

    # One lease lapse, the cut's; one hand-over and one fencing; no stall, no timeout.
    handed = log.of(HandedOver)
    assert len(handed) == 1 and "lease expired" in handed[0].reason, handed
    assert [f.worker for f in log.of(Fenced)] == [EDGE]
    assert [s.worker for s in log.of(Started)] == [EDGE, HUB_TRAINER]
    assert not log.of(Redispatched) and not log.of(RunWarning), log.of(RunWarning)
    assert record.warned == [] and record.stop_token is None and record.retries == 0
    assert record.attempts == 2 and record.token == takeover.token

    # The skew is really there: the trainers' own times are minutes off the hub's stamps.
    events = await stored(nc, run_id)
    off = {e.worker: e.at - s for e, s in events if isinstance(e, Started)}
    assert off[EDGE] == pytest.approx(SKEW_S, abs=30), off
    assert off[HUB_TRAINER] == pytest.approx(-SKEW_S, abs=30), off
    raw = goodput([e for e, _ in events])
    assert raw is not None and max(abs(v) for v in raw.seconds().values()) > SKEW_S / 2, (
        "read on the publishers' clocks, the history has phantom minutes (what was fixed)"
    )

    # Goodput, read as the CLI reads it (on the hub's clock): no phantom, nothing negative,
    # nothing longer than the hub's own stamps say the run took.
    span = events[-1][1] - events[0][1]
    spent = goodput(await client.history(nc, run_id))
    assert spent is not None and spent.finished and spent.attempts == 2
    assert sum(spent.seconds().values()) == pytest.approx(spent.wall_s)
    assert 0 < spent.wall_s <= span + 1.0, (spent, span)
    assert all(v >= -1e-6 for v in spent.seconds().values()), spent
    assert abs(spent.other_s) < 0.05 * spent.wall_s, spent
    assert spent.queued_s < span and spent.recovery_s < span, spent
    # The reaper's export of the same run (its log line is the exported wall time).
    exported = await eventually(lambda: _exported(hub, run_id), 30, "the goodput export")
    assert 0 < exported <= span + 1.0, (exported, span)

    # The trainers' ages, as `baton workers` shows them: heard seconds ago, not ±5 minutes.
    seen = {w.worker: (s, w.at) for w, s in await client.workers_seen(nc)}
    for worker in (EDGE, HUB_TRAINER):
        age, at = seen[worker]
        assert 0 <= age < 60, (worker, age)
        assert abs(time.time() - at) > SKEW_S / 2, "its heartbeat's own time is skewed"

    # Bit for bit the uninterrupted run's weights.
    ref = await finished(nc, reference, timeout=90)
    assert ref.state is RunState.COMPLETED and record.digest == ref.digest

    # Retired once over for BATON_GC_AGE on the server's clock — not on the hub trainer's,
    # which wrote `updated_at` 5 minutes behind (it would have retired at once).
    await eventually(lambda: _retired(nc, run_id), GC_AGE + 60, "the run to retire")
    archived = await nc.jetstream().get_msg(
        names.ARCHIVE_STREAM, subject=names.archive_subject(run_id)
    )
    completed_at = next(s for e, s in events if isinstance(e, Completed))
    assert archived.time is not None
    assert archived.time.timestamp() - completed_at >= GC_AGE, "retired too soon"
    assert (await archive.find(nc.jetstream(), run_id)) is not None

    # Retention kept the newest three of the chain, the final one first, the hub trainer's;
    # and nothing else of the run is left: the fenced edge's uploads were collected.
    async with open_store(hub.store_url) as store:
        chain = await retention.committed_chain(store, run_id)
        assert [m.step for m in chain] == [300, 290, 280], [m.step for m in chain]
        assert chain[0].final and chain[0].token == takeover.token
        kept = {f.key for m in chain for f in m.files}
        left = set(await store.list(f"runs/{run_id}/data/"))
        assert left == kept, sorted(left ^ kept)
    log.close()


async def _heard(nc: Client, worker: str) -> bool:
    return any(w.worker == worker for w, _ in await client.workers_seen(nc))


async def _retired(nc: Client, run_id: str) -> bool:
    """Archived, and out of the live index (`Runs.retire` does both, in that order)."""
    js = nc.jetstream()
    if await archive.find(js, run_id) is None:
        return False
    return run_id not in await (await Runs.open(js)).live_ids()


async def _exported(hub: Stack, run_id: str) -> float | None:
    found = re.search(rf"{re.escape(run_id)}: goodput [\d.]+% of ([\d.]+)s", hub.log("reaper"))
    return float(found[1]) if found else None
