"""A site trains over a degraded WAN: late, narrow, and flapping links.

The hub (nats-server in domain `hub`, dispatcher, checkpointer, reaper) and the site `lab1`
(leaf nats-server, its checkpointer and trainer) are real processes, the store a real
SeaweedFS. The site reaches the hub's WebSocket and the store each through a `Link`
(tests/support/link.py, tests/support/wan.py) that delays, caps or flaps them; the hub
reaches the store directly. The job is user-shaped: a wide MLP whose checkpoints weigh a
few MB, fed by a DataLoader (`tests.support.workloads:wide`).

Each test runs the job once on clean links for the reference digest, degrades the links,
runs it again, and asserts: COMPLETED; weights bitwise equal to the reference; the leaf
link reconnected no more than it was cut, plus a small constant (no reconnect storm); the
site's outbox drained (after every flap, and at the end) and its events reached the hub
once and in order; no nats-server of the stack logged a permission `Violation`. Nothing
waits on the clock except the faults themselves (a flap's schedule); no bound is put on
how fast Baton is, only on how long the test may wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.events import CheckpointCommitted, Completed
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.link import MBIT, Flapper, Wire
from tests.support.seaweed import SeaweedS3
from tests.support.sites import hub_leaves
from tests.support.stack import eventually
from tests.support.wan import Wan, open_wan, undrained

WIDE = "tests.support.workloads:wide"
SEED = 5
DELAY_S, JITTER_S = 0.1, 0.025
"""100 ± 25 ms each way: 200 ± 50 ms round trips."""
UPLOAD_CAP = 1.5 * MBIT
"""`BATON_UPLOAD_BPS` under a 2 Mbit/s uplink: a quarter of it left for the NATS link."""
RECONNECT_SLACK = 2
_references: dict[tuple[int, int], str] = {}


def wide(total: int, every: int, width: int, pace: float = 0.0) -> JobSpec:
    """`width` 4096: 1.07 MB of weights, 2.1 MB a checkpoint with momentum; 8192: 4.3 MB."""
    return job(
        entry_point=WIDE,
        total_steps=total,
        checkpoint={"every_steps": every},
        config={"width": width, "pace": pace},
        seed=SEED,
    )


@pytest.fixture
def seaweed() -> Iterator[SeaweedS3]:
    with SeaweedS3() as server:
        yield server


async def reference(nc: Client, total: int, width: int) -> str:
    """The digest of the job run straight through, on clean links (pace only sleeps and the
    checkpoints' cadence changes nothing an uninterrupted run computes)."""
    key = (total, width)
    if key not in _references:
        rec = await finished(nc, await submit(nc, wide(total, total, width)), timeout=120)
        assert rec.state is RunState.COMPLETED and rec.digest, rec
        _references[key] = rec.digest
    return _references[key]


async def drained(w: Wan, timeout: float, what: str) -> float:
    """Until the hub holds everything the site's outbox held when this was called (and
    whatever came since); returns how long that took."""
    hub_nc, site_nc = await w.hub.client(), await w.site.client()
    started = time.monotonic()

    async def caught_up() -> bool:
        return not await undrained(w, hub_nc, site_nc)

    await eventually(caught_up, timeout, what, every=0.05)
    return time.monotonic() - started


async def run_through(w: Wan, nc: Client, spec: JobSpec, timeout: float) -> RunRecord:
    """Submit `spec`, wait until it ends, and check what every test here checks of it."""
    run_id = await submit(nc, spec)
    log = EventLog(nc, run_id)
    record = await finished(nc, run_id, timeout=timeout)
    assert record.state is RunState.COMPLETED and record.step == spec.total_steps, record
    await log.wait_for(lambda e: isinstance(e, Completed), 60, "completed at the hub")
    commits = log.of(CheckpointCommitted)
    assert len(commits) >= 2, f"want a periodic and a final commit over the link: {commits}"
    log.close()
    await drained(w, 60, "the site's outbox to drain at the end")
    await w.site.assert_events_once_in_order(nc, run_id)
    assert await hub_leaves(w.hub) == 1, "the site's leaf is linked to the hub once"
    assert w.hub.audit.findings() == [], w.hub.audit.findings()
    return record


class Tally:
    """What crossed the store link from now on, and how long that took."""

    def __init__(self, w: Wan) -> None:
        self.w = w
        self.started = time.monotonic()
        self.up, self.down = w.store.delivered[True], w.store.delivered[False]
        self.conns = w.store.accepted

    @property
    def sent(self) -> int:
        return self.w.store.delivered[True] - self.up

    def report(self, label: str, **extra: Any) -> None:
        elapsed = time.monotonic() - self.started
        down = self.w.store.delivered[False] - self.down
        print(
            f"{label}: run took {elapsed:.1f} s; store link: {self.sent / 1e6:.2f} MB up "
            f"({self.sent / elapsed / 1e3:.0f} kB/s on average), {down / 1e6:.2f} MB down, "
            f"{self.w.store.accepted - self.conns} connections; "
            + ", ".join(f"{k} {v}" for k, v in extra.items())
        )


@pytest.mark.soak
@pytest.mark.timeout(240)
async def test_a_site_trains_over_200ms_round_trips_with_jitter(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    total, width = 90, 8192  # 4.3 MB checkpoints
    async with open_wan(tmp_path, seaweed) as w:
        nc = await w.hub.client()
        want = await reference(nc, total, width)
        before = w.leaf.accepted
        w.leaf.shape(delay_s=DELAY_S, jitter_s=JITTER_S)
        w.store.shape(delay_s=DELAY_S, jitter_s=JITTER_S)
        tally = Tally(w)
        record = await run_through(w, nc, wide(total, 30, width, pace=0.05), timeout=180)
        assert record.digest == want, "weights differ from the uninterrupted reference"
        reconnects = w.leaf.accepted - before
        assert reconnects <= RECONNECT_SLACK, f"{reconnects} reconnects with no cut at all"
        tally.report("200±50 ms RTT", leaf_reconnects=reconnects)


@pytest.mark.soak
@pytest.mark.timeout(240)
async def test_a_site_trains_over_a_2_mbit_uplink_with_uploads_capped(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    total, width = 60, 4096  # 2.1 MB checkpoints: 11 s each at the cap, 8.5 s read back
    site_env = {"BATON_UPLOAD_BPS": f"{UPLOAD_CAP:.0f}"}
    async with open_wan(tmp_path, seaweed, site_env=site_env) as w:
        nc = await w.hub.client()
        want = await reference(nc, total, width)
        before = w.leaf.accepted
        # One uplink: the leaf's link and the store's share each direction's 2 Mbit/s.
        up, down = Wire(2 * MBIT), Wire(2 * MBIT)
        w.leaf.shape(up=up, down=down)
        w.store.shape(up=up, down=down)
        tally = Tally(w)
        record = await run_through(w, nc, wide(total, 30, width, pace=0.2), timeout=200)
        elapsed = time.monotonic() - tally.started
        assert record.digest == want, "weights differ from the uninterrupted reference"
        reconnects = w.leaf.accepted - before
        assert reconnects <= RECONNECT_SLACK, f"{reconnects} reconnects with no cut at all"
        # What the site sent the store stayed within the cap (each upload's own rate is
        # tests/shared/checkpoint/test_upload.py's; this is the run's as a whole).
        assert tally.sent >= 2 * 2_000_000, f"two checkpoints went up: {tally.sent} bytes"
        assert tally.sent <= UPLOAD_CAP * elapsed + 64_000, f"{tally.sent / elapsed:.0f} B/s"
        tally.report("2 Mbit/s", leaf_reconnects=reconnects)


@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_a_site_trains_through_three_minutes_of_flapping(
    tmp_path: Path, seaweed: SeaweedS3
) -> None:
    total, width, pace = 1500, 8192, 0.12  # about 3 minutes of training, 4.3 MB checkpoints
    flapping_s = 180.0
    drains: list[float] = []
    async with open_wan(tmp_path, seaweed, lease_ttl=10) as w:
        w.hub.audit.allow(r"nats: timeout|JetStream API timeout", "the leaf link flaps on purpose")
        nc = await w.hub.client()
        want = await reference(nc, total, width)
        w.store.shape(delay_s=DELAY_S, jitter_s=JITTER_S)

        behind: list[list[str]] = []
        hub_nc, site_nc = await w.hub.client(), await w.site.client()

        async def after_restore(n: int) -> None:
            behind.append(await undrained(w, hub_nc, site_nc))  # what the cut held back
            drains.append(await drained(w, 60, f"the outbox to drain after flap {n}"))

        before = w.leaf.accepted
        run_id = await submit(nc, wide(total, 250, width, pace=pace))
        flapper = Flapper(w.leaf, up_s=(5, 30), down_s=(1, 4), seed=7, after_restore=after_restore)
        tally = Tally(w)
        started = time.monotonic()
        async with flapper:
            # The fault's own length: flap for three minutes, or until the run ended first.
            async def over() -> bool:
                return time.monotonic() - started >= flapping_s or await _ended(nc, run_id)

            await eventually(over, flapping_s + 60, "three minutes of flapping", every=1.0)
        record = await finished(nc, run_id, timeout=240)
        assert record.state is RunState.COMPLETED and record.step == total, record
        assert record.digest == want, "weights differ from the uninterrupted reference"
        await drained(w, 60, "the site's outbox to drain at the end")
        await w.site.assert_events_once_in_order(nc, run_id)
        assert await hub_leaves(w.hub) == 1
        assert w.hub.audit.findings() == [], w.hub.audit.findings()
        reconnects = w.leaf.accepted - before
        assert flapper.flaps >= 5, f"too few flaps to tell anything: {flapper.cuts}"
        assert reconnects <= flapper.flaps + RECONNECT_SLACK, (
            f"{reconnects} reconnects for {flapper.flaps} flaps: a reconnect storm"
        )
        # Every flap's check ran to the end but perhaps the last, which the stop may cut;
        # and the check was not vacuous: cuts held events back that then drained.
        assert len(drains) >= flapper.flaps - 1, (len(drains), flapper.flaps)
        assert sum("events" in b for b in behind) >= len(behind) // 2, behind
        minutes = (time.monotonic() - started) / 60
        tally.report(
            "flapping", flaps=flapper.flaps, leaf_reconnects=reconnects,
            reconnects_per_min=f"{reconnects / minutes:.1f}",
            drain_s=f"max {max(drains):.2f}, median {sorted(drains)[len(drains) // 2]:.2f}",
        )  # fmt: skip


async def _ended(nc: Client, run_id: str) -> bool:
    from shared.state.runs import Runs

    found = await (await Runs.open(nc.jetstream())).get(run_id)
    return bool(found and found[0].state.terminal)
