"""Baton over degraded links: catch-up after a flap, checkpoint upload time, control traffic
under an upload, and reconnects per minute under a 5-second flap. Each figure is measured
on a clean link, under 200 ± 50 ms round trips and under a 2 Mbit/s uplink, in one run.

    .venv/bin/python -m bench.links [--rounds 3] [--cut 5] [--mb 4.3] [--uploads 2]
                                    [--flap-minutes 1]

One hub and one site as real processes (tests/support/wan.py): the site's leaf reaches the
hub's WebSocket, and the site reaches SeaweedFS, each through a `Link`
(tests/support/link.py). A job runs at the site throughout (`tests.support.workloads:wide`,
a step every 50 ms, progress events every 0.1 s, heartbeats, logs), so its outbox fills
during every cut. Per link condition — *clean*; *200 ms*: 100 ± 25 ms each way on both
links; *2 Mbit/s*: one 2 Mbit/s Wire per direction shared by both links, a site's uplink:

* **flap**: the leaf link is severed for `--cut` s plus a random fraction of a second (the
  leaf redials every second: the fraction puts the restore at any phase of it), then
  restored, `--rounds` times. *redial*: restore → the leaf's next dial reaches the link.
  From that dial: *relink*, until the hub's `/leafz` lists the leaf again (polled every
  20 ms), and *drained*, until the hub holds the newest outbox message of every kind the
  site sent (`tests.support.wan.undrained`, polled every 20 ms): the outbox caught up.
* **upload**: `put_file` of an `--mb` MB file through the store link from this process
  (the S3 store the training process uploads with, a new connection each time), then
  `stat` — the read-back the checkpointer verifies a commit with; `--uploads` times, after
  one unmeasured upload on the clean link (SeaweedFS allocates its first volume). Under
  2 Mbit/s also with `BATON_UPLOAD_BPS` at 1.5 Mbit/s.
* **control RTT**: median round trip of a site trainer's request to the hub's JetStream
  (`$JS.hub.API.INFO`, as a trainer's lease and KV calls cross the leaf link), idle, during
  the upload and, under 2 Mbit/s, during the capped upload.

Then, on clean links, **reconnects per minute** under a 5-second flap (up 5 s, down 1 s)
for `--flap-minutes`: connections the leaf link accepted, and dials it refused while down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client

from shared.checkpoint.store.s3 import S3Store
from shared.contracts import JobSpec
from tests.e2e.jobs import job, submit
from tests.support.link import MBIT, Flapper, Wire
from tests.support.seaweed import SeaweedS3
from tests.support.sites import hub_leaves
from tests.support.stack import eventually
from tests.support.wan import Wan, open_wan, undrained

DELAY_S, JITTER_S = 0.1, 0.025
"""100 ± 25 ms each way: 200 ± 50 ms round trips."""
CAP = 1.5 * MBIT
POLL_S = 0.02


async def timed(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    started = time.monotonic()
    await eventually(check, timeout, what, every=POLL_S)
    return time.monotonic() - started


async def flap(w: Wan, hub_nc: Client, site_nc: Client, cut_s: float) -> tuple[float, float, float]:
    """One cut of the leaf link: (restore → the leaf dials, dial → relinked at the hub,
    dial → outbox drained)."""
    w.leaf.sever()
    await asyncio.sleep(cut_s)  # the fault itself
    dials = w.leaf.accepted
    w.leaf.restore()
    restored = time.monotonic()

    async def dialled() -> bool:
        return w.leaf.accepted > dials

    async def linked() -> bool:
        return await hub_leaves(w.hub) == 1

    async def drained() -> bool:
        return not await undrained(w, hub_nc, site_nc)

    await eventually(dialled, 60, "the leaf to dial again", every=0.005)
    dialled_at = time.monotonic()
    relink = await timed(linked, 60, "the leaf to relink")
    await eventually(drained, 120, "the outbox to drain", every=POLL_S)
    return dialled_at - restored, relink, time.monotonic() - dialled_at


async def control_rtt(nc: Client, until: asyncio.Future[float] | None) -> float:
    """Median round trip of `$JS.hub.API.INFO` from a site trainer's connection (`nc`): of
    10, or of those sent before `until` is done (at least 3)."""
    samples: list[float] = []
    while len(samples) < (10 if until is None else 3) or (until is not None and not until.done()):
        started = time.monotonic()
        await nc.request("$JS.hub.API.INFO", b"", timeout=30)
        samples.append(time.monotonic() - started)
        await asyncio.sleep(0.1)  # a sampling interval, not a wait for anything
    return statistics.median(samples)


async def upload(
    w: Wan, seaweed: SeaweedS3, path: Path, nc: Client, cap: float
) -> tuple[float, float, float]:
    """(upload s, read-back s, median control RTT during the upload)."""
    store = S3Store(seaweed.bucket, f"bench-{uuid.uuid4().hex[:8]}", endpoint=w.store.endpoint,
                    upload_bps=cap)  # fmt: skip
    async with store:
        spool = path.with_name(f"{path.name}.{uuid.uuid4().hex[:6]}")
        os.link(path, spool)  # put_file consumes its file

        async def put() -> float:
            started = time.monotonic()
            await store.put_file("ckpt", spool)
            return time.monotonic() - started

        putting = asyncio.ensure_future(put())
        rtt = await control_rtt(nc, putting)
        up_s = await putting
        started = time.monotonic()
        await store.stat("ckpt")
        return up_s, time.monotonic() - started, rtt


async def condition(
    label: str, w: Wan, seaweed: SeaweedS3, nc: Client, site_nc: Client, a: argparse.Namespace,
    path: Path,
) -> dict[str, str]:  # fmt: skip
    row = {"link": label}
    # Cuts of --cut plus up to a second, so the leaf's redial (every second) comes at any
    # phase of the restore; the figures after it are measured from the dial.
    rng = random.Random(a.rounds)
    flaps = [await flap(w, nc, site_nc, a.cut + rng.random()) for _ in range(a.rounds)]
    row["redial"] = _spread([f[0] for f in flaps])
    row["relink"] = _spread([f[1] for f in flaps])
    row["drained"] = _spread([f[2] for f in flaps])
    trainer = await w.site.client("trainer")
    row["rtt idle"] = f"{await control_rtt(trainer, None) * 1e3:.0f} ms"
    got = [await upload(w, seaweed, path, trainer, 0.0) for _ in range(a.uploads)]
    row["upload"] = _all([g[0] for g in got], "s")
    row["read back"] = _all([g[1] for g in got], "s")
    row["rtt, upload"] = _all([g[2] * 1e3 for g in got], "ms")
    if label.startswith("2 Mbit"):
        got = [await upload(w, seaweed, path, trainer, CAP) for _ in range(a.uploads)]
        row["upload, capped"] = _all([g[0] for g in got], "s")
        row["rtt, capped upload"] = _all([g[2] * 1e3 for g in got], "ms")
    print(f"  {row}", flush=True)
    return row


def _all(xs: list[float], unit: str) -> str:
    return " / ".join(f"{x:.2f}" if unit == "s" else f"{x:.0f}" for x in xs) + f" {unit}"


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}–{max(xs):.2f})"


async def reconnects(w: Wan, minutes: float) -> str:
    accepted, refused = w.leaf.accepted, w.leaf.refused
    flapper = Flapper(w.leaf, up_s=(5, 5), down_s=(1, 1), seed=3)
    started = time.monotonic()
    async with flapper:
        await asyncio.sleep(minutes * 60)  # the fault schedule's own length
    span = (time.monotonic() - started) / 60

    async def linked() -> bool:  # the stop restored the link: count the last reconnect too
        return await hub_leaves(w.hub) == 1

    await eventually(linked, 60, "the leaf to relink after the last flap")
    got, dials = w.leaf.accepted - accepted, w.leaf.refused - refused
    return (
        f"{flapper.flaps} flaps in {span:.2f} min: {got / span:.1f} reconnects/min "
        f"({got / max(flapper.flaps, 1):.2f} per flap), {dials / span:.1f} refused dials/min"
    )


def background_job() -> JobSpec:
    """Trains for as long as the bench runs (the stack's stop ends it), never checkpoints."""
    return job(
        entry_point="tests.support.workloads:wide",
        total_steps=1_000_000,
        checkpoint={"every_steps": 1_000_000},
        config={"width": 1024, "pace": 0.05},
    )


async def main(a: argparse.Namespace) -> int:
    cols = ["link", "redial", "relink", "drained", "upload", "read back", "upload, capped",
            "rtt idle", "rtt, upload", "rtt, capped upload"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-links-") as tmp, SeaweedS3() as seaweed:
        for name, value in seaweed.env().items():
            os.environ[name] = value
        root = Path(tmp)
        path = root / "ckpt.bin"
        path.write_bytes(os.urandom(int(a.mb * 1e6)))
        async with open_wan(root, seaweed, lease_ttl=10) as w:
            w.hub.audit.allow(r"nats: timeout|JetStream API timeout", "the bench cuts the link")
            nc, site_nc = await w.hub.client(), await w.site.client()
            await submit(nc, background_job())
            print(f"links bench: {a.rounds} cuts of {a.cut:g} s per link, {a.mb:g} MB uploads")
            await upload(w, seaweed, path, await w.site.client("trainer"), 0.0)  # warm-up
            rows = [await condition("clean", w, seaweed, nc, site_nc, a, path)]
            w.leaf.shape(delay_s=DELAY_S, jitter_s=JITTER_S)
            w.store.shape(delay_s=DELAY_S, jitter_s=JITTER_S)
            rows.append(await condition("200±50 ms RTT", w, seaweed, nc, site_nc, a, path))
            up, down = Wire(2 * MBIT), Wire(2 * MBIT)
            w.leaf.shape(up=up, down=down)
            w.store.shape(up=up, down=down)
            rows.append(await condition("2 Mbit/s uplink", w, seaweed, nc, site_nc, a, path))
            w.leaf.shape()
            w.store.shape()
            flapping = await reconnects(w, a.flap_minutes)
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for row in rows:
        print("| " + " | ".join(row.get(c, "–") for c in cols) + " |")
    print(f"\n5-second flap (up 5 s, down 1 s), clean link: {flapping}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=3, help="cuts per link condition")
    ap.add_argument("--cut", type=float, default=5.0, help="seconds each cut lasts")
    ap.add_argument("--mb", type=float, default=4.3, help="MB of the uploaded checkpoint")
    ap.add_argument("--uploads", type=int, default=2, help="uploads per link condition")
    ap.add_argument("--flap-minutes", type=float, default=1.0, help="length of the 5 s flap")
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(asyncio.run(main(ap.parse_args())))
