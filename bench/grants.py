"""A site through a partition, with grants (docs/sites.md): how busy its trainers stay while
cut off, and how soon the hub is consistent after heal.

    .venv/bin/python -m bench.grants [--cuts 30,120] [--run-s 20] [--heal 10,100]
                                     [--skip-baseline]
    .venv/bin/python -m bench.grants --by-time 60,300 [--run-s 20]
    .venv/bin/python -m bench.grants --whole-cut 600 [--run-s 20]

**Utilisation.** A hub with no trainer (dispatcher, checkpointer, reaper) and site `lab1`
(leaf node behind a loopback proxy, its checkpointer, dispatcher and two trainers), real
processes under `baton up`'s authorization. Runs of about `--run-s` seconds each are queued
at the hub — enough for both trainers through the cut and one run more; once both trainers
train, the leaf's link is cut for C seconds. Busy trainer-seconds inside the cut are read
off the site's own events (each attempt from `started` to its end, on the site host's
clock — the same host here) over 2·C. With grants (`BATON_DELEGATE_AHEAD` = the runs a
trainer needs to cover the cut) against the baseline in the same run, grants off
(`BATON_DELEGATE_AHEAD=0`: the trainers take the hub's queue across the link, as before).

**By count against by time** (`--by-time CUTS`): the same stack and runs (each with its
`estimate_s`), for each cut, grants by count at their default (`BATON_DELEGATE_AHEAD=1`)
against grants by time with a horizon of the cut's length (`BATON_GRANT_AHEAD_S=C`; the cut
begins once the site was granted that much, or every run): the share of the cut the site's
trainers trained, each.

**A whole cut, end to end** (`--whole-cut C`): grants by time with a horizon of the cut,
the hub's queue holding more work than the cut can use; the share of the cut the site's
trainers trained, then, at heal: every run the site started completes once (one
`completed` event at the hub), each with the weights of the same job run uninterrupted
(the reference, trained before the cut), and how long after the link is restored the hub
holds every outcome the site reached during the cut (records ended, from `restore`).

**Heal → consistent.** N short runs granted to the site (two trainers, `ahead` N/2), the
link cut before they start; once every run completed at the cut-off site (its outbox says
so), the link is restored and the bench times restore → every run's record at the hub
COMPLETED and its `completed` event stored at the hub.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from functools import partial
from pathlib import Path

from nats.aio.client import Client

from baton.client.holdings import site_views
from shared.bus import names
from shared.contracts import RunState
from shared.contracts.events import Completed
from shared.state.runs import Runs
from tests.e2e.jobs import history, paced, submit
from tests.support.busy import busy_within, site_events
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

HUB_ONLY = ("dispatcher", "checkpointer", "reaper")
PACE = 0.05


async def stack(tmp: Path, ahead: int, horizon_s: float = 0.0) -> tuple[Stack, Site]:
    env = {"BATON_DELEGATE_AHEAD": str(ahead)}
    if horizon_s:
        env["BATON_GRANT_AHEAD_S"] = f"{horizon_s:g}"
    hub = Stack(tmp / "hub", trainers=0, lease_ttl=6, env=env)
    await hub.start(HUB_ONLY)
    site = Site(hub, "lab1")
    await site.start(trainers=2)
    return hub, site


async def utilisation(
    cut_s: float, run_s: float, grants: bool, ahead: int | None = None, horizon_s: float = 0.0
) -> float:
    """Busy share of the site's trainer-seconds through a cut of `cut_s`: grants sized for
    the cut by count (`grants`), or `ahead` runs per trainer, or by time (`horizon_s`)."""
    steps = max(10, round(run_s / PACE))
    per_trainer = math.ceil(cut_s / run_s) + 1
    if ahead is None:
        ahead = per_trainer if grants else 0
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        hub, site = await stack(Path(tmp), ahead, horizon_s)
        try:
            nc = await hub.client()
            start, end = await _queue_and_cut(nc, site, steps, per_trainer, horizon_s, cut_s)
            site.proxy.restore()
            busy = busy_within(await site_events(site), start, end)
            return busy / (2 * (end - start))
        finally:
            await hub.stop()


async def _queue_and_cut(
    nc: Client, site: Site, steps: int, per_trainer: int, horizon_s: float, cut_s: float
) -> tuple[float, float]:
    """Queue at the hub more runs than the cut can use, wait until both trainers train
    (and, with a horizon, the site holds it), and cut the link for `cut_s`: the cut's start
    and end (the site host's clock, the same host here); the link is left cut."""
    # More than the cut can use by a quarter: runs complete while a long horizon is being
    # granted (a 900 s one is ninety runs), and what is left must still fill it.
    count = 2 * (per_trainer + 1) * 5 // 4
    run_ids = [  # each its own idempotency key: one run each
        await submit(nc, paced(steps, pace=PACE, estimate_s=steps * PACE)) for _ in range(count)
    ]
    await eventually(lambda: _training(nc, run_ids, 2), 120, "both trainers to train")
    if horizon_s:  # granted as far as the horizon reaches before the cut
        await eventually(lambda: _granted_s(nc, run_ids, horizon_s), max(120.0, horizon_s / 2),
                         "the site to be granted its horizon")  # fmt: skip
    site.proxy.sever()
    start = time.time()
    await asyncio.sleep(cut_s)  # the cut's length is the measurement's
    return start, time.time()


async def whole_cut(cut_s: float, run_s: float) -> None:
    """`--whole-cut`: see the module's docstring; prints its findings, and fails loudly on a
    run that ended other than once, exact."""
    steps = max(10, round(run_s / PACE))
    per_trainer = math.ceil(cut_s / run_s) + 1
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        hub, site = await stack(Path(tmp), 1, cut_s)
        try:
            nc = await hub.client()
            reference = await submit(nc, paced(steps, pace=0.0))
            await eventually(lambda: _completed(nc, [reference]), 300, "the reference")
            runs = await Runs.open(nc.jetstream())
            found = await runs.get(reference)
            assert found is not None and found[0].digest
            want = found[0].digest
            start, end = await _queue_and_cut(nc, site, steps, per_trainer, cut_s, cut_s)
            events = await site_events(site)
            busy = busy_within(events, start, end) / (2 * (end - start))
            done = {e.run_id for kind, e in events if kind == "completed"}
            started = {e.run_id for kind, e in events if kind == "started"}
            site.proxy.restore()
            healed = time.monotonic()
            await eventually(lambda: _completed(nc, sorted(done)), 120, "the site's outcomes",
                             every=0.02)  # fmt: skip
            known_s = time.monotonic() - healed
            await eventually(lambda: _completed(nc, sorted(started)), 600, "every started run")
            digests = set()
            for run_id in sorted(started):
                record = await runs.get(run_id)
                assert record is not None
                digests.add(record[0].digest)
                await eventually(partial(_completed_events, nc, run_id), 60, f"{run_id}'s end")
            assert digests == {want}, f"weights other than the uninterrupted run's: {digests}"
        finally:
            await hub.stop()
    print(f"| {cut_s:.0f} s | {busy:.1%} | {len(done)} | {len(started)} | {known_s:.2f} s |")


async def heal(n: int) -> tuple[float, float]:
    """(restore → every record COMPLETED at the hub, → every `completed` event at the hub)."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        hub, site = await stack(Path(tmp), max(1, n // 2))
        try:
            nc = await hub.client()
            run_ids = [await submit(nc, paced(5, pace=0.0)) for _ in range(n)]
            await eventually(lambda: _granted(nc, run_ids), 120, "every run to be granted")
            site.proxy.sever()

            async def done_at_site() -> bool:
                got = await site.outbox(names.site_root(site.name, "events"))
                ended = {s.split(".")[4] for s, _ in got if s.endswith(".completed")}
                return ended >= {r.rpartition(".")[2] for r in run_ids}

            await eventually(done_at_site, 60 + 5 * n, "every run done at the cut-off site")
            site.proxy.restore()
            began = time.monotonic()
            await eventually(lambda: _completed(nc, run_ids), 120, "records", every=0.02)
            records = time.monotonic() - began
            await eventually(lambda: _events(nc, n), 120, "events", every=0.02)
            return records, time.monotonic() - began
        finally:
            await hub.stop()


async def _training(nc: Client, run_ids: list[str], n: int) -> bool:
    runs = await Runs.open(nc.jetstream())
    found = [await runs.get(r) for r in run_ids]
    return sum(1 for f in found if f and f[0].state is RunState.RUNNING) >= n


async def _granted(nc: Client, run_ids: list[str]) -> bool:
    runs = await Runs.open(nc.jetstream())
    found = [await runs.get(r) for r in run_ids]
    return all(f and f[0].site for f in found)


async def _granted_s(nc: Client, run_ids: list[str], horizon_s: float) -> bool:
    """Whether the site's granted horizon, as the hub reckons it (`baton sites`: expected
    seconds of the runs it holds per live trainer there, by the job's measured speed), has
    reached `horizon_s` — or every run is granted."""
    views = {v.site: v for v in await site_views(nc)}
    held = views.get("lab1")
    if held is not None and held.horizon_s is not None and held.horizon_s >= horizon_s:
        return True
    runs = await Runs.open(nc.jetstream())
    found = [f[0] for r in run_ids if (f := await runs.get(r))]
    return all(r.site for r in found)


async def _completed(nc: Client, run_ids: list[str]) -> bool:
    runs = await Runs.open(nc.jetstream())
    found = [await runs.get(r) for r in run_ids]
    return all(f and f[0].state is RunState.COMPLETED for f in found)


async def _completed_events(nc: Client, run_id: str) -> bool:
    """Whether the run's one `completed` event is at the hub (never more than one)."""
    found = [e for e in await history(nc, run_id) if isinstance(e, Completed)]
    assert len(found) <= 1, f"{run_id} completed {len(found)} times"
    return len(found) == 1


async def _events(nc: Client, n: int) -> bool:
    info = await nc.jetstream().stream_info(names.EVENTS_STREAM, subjects_filter="*.*.*.completed")
    return len(info.state.subjects or {}) >= n


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuts", default="30,120")
    p.add_argument("--run-s", type=float, default=20.0)
    p.add_argument("--heal", default="10,100")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--by-time", default="", help="cuts (s) to compare count and time at")
    p.add_argument("--whole-cut", type=float, default=0.0, help="one cut (s), end to end")
    a = p.parse_args()
    if a.whole_cut:
        print("| cut | busy | runs done in the cut | runs started | heal → outcomes known |")
        print("|---|---|---|---|---|")
        await whole_cut(a.whole_cut, a.run_s)
        return
    if a.by_time:
        await by_time([float(c) for c in a.by_time.split(",") if c], a.run_s)
        return
    print("| cut | grants | baseline (grants off) |\n|---|---|---|")
    for cut in (float(c) for c in a.cuts.split(",") if c):
        with_grants = await utilisation(cut, a.run_s, grants=True)
        base = "-" if a.skip_baseline else f"{await utilisation(cut, a.run_s, False):.1%}"
        print(f"| {cut:.0f} s | {with_grants:.1%} | {base} |", flush=True)
    print("\n| runs done at the site | → records | → events |\n|---|---|---|")
    for n in (int(x) for x in a.heal.split(",") if x):
        records, events = await heal(n)
        print(f"| {n} | {records:.2f} s | {events:.2f} s |", flush=True)


async def by_time(cuts: list[float], run_s: float) -> None:
    """Grants by count (the default: one run ahead per trainer) against grants by time (a
    horizon of the cut's length), for each cut, in the same run."""
    print("| cut | by count (1 ahead) | by time (horizon = cut) |\n|---|---|---|")
    for cut in cuts:
        count = await utilisation(cut, run_s, grants=True, ahead=1)
        timed = await utilisation(cut, run_s, grants=True, ahead=1, horizon_s=cut)
        print(f"| {cut:.0f} s | {count:.1%} | {timed:.1%} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
