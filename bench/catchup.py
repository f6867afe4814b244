"""Catch-up after heal: events buffered at the edge while the WAN was cut, and how fast the
hub takes them in once the link is back, with and without re-attaching ("nudging") the
hub's source. Ratios are against baselines measured in the same run.

    .venv/bin/python -m bench.catchup [--events 10000] [--cuts 5,30,120]
                                      [--compare-no-nudge 30 | --no-compare]

Each measurement gets a fresh hub (domain `hub`) and a fresh leaf (domain `--site`) that
dials the hub's WebSocket through a loopback `Proxy`; the hub's streams source the site's
outbox (`shared.bus.sourcing.link`), as in Baton.

* live: the link is up and sourced; N events are published at the site. Time from the last
  publish-ack to the last event at the hub, and N / (first publish → last event at hub).
* drain: N events wait in the outbox before the hub has any source; time from attaching
  the source (link up) to the last event at the hub. The copy rate with no cut involved.
* cut: the proxy severs the link; N events are published at the site (each acknowledged
  by the outbox); the link stays cut until the cut length has passed since the sever; then
  restored. "Link-up" is the first moment a hub client's request to `$JS.<site>.API.INFO`
  is answered. With the nudge, `sites.link(nudge=True)` is called right then, as Baton's
  reaper does on a site's first greeting after a silence. Time from link-up to the last
  event at the hub.

Every measurement checks that the hub holds exactly the outbox's N events, once each and
in the outbox's order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from baton.stack.natsconf import hub_fragment, leaf_fragment
from baton.stack.natsserver import NatsServer
from shared.bus import names
from shared.bus import sourcing as sites
from shared.bus.connect import connect
from shared.bus.streams import ensure, ensure_site
from tests.support.proxy import Proxy
from tests.support.sites import stored

RUN = "catchup"
PAYLOAD_BYTES = 200
POLL_S = 0.01


@dataclass
class Pair:
    hub: NatsServer
    leaf: NatsServer
    proxy: Proxy
    hub_nc: Client
    hub_js: JetStreamContext
    site_nc: Client
    site_js: JetStreamContext
    site: str


@dataclass
class Result:
    label: str
    nudged: str
    since: str
    """What the time is measured from."""
    seconds: float | None
    """None: not every event arrived within the timeout."""
    events: int
    arrived: int
    cut_s: float | None = None
    relink_s: float | None = None
    """Restore → link-up."""
    first_s: float | None = None
    """Link-up (or attach) → first event at the hub."""
    lag_s: float | None = None
    """Live only: last publish-ack → last event at the hub."""
    publish_rate: float | None = None
    ok: bool = True
    problem: str = ""

    @property
    def rate(self) -> float | None:
        return self.events / self.seconds if self.seconds else None


@contextlib.asynccontextmanager
async def pair(root: Path, site: str, *, linked: bool) -> AsyncIterator[Pair]:
    """A hub and a leaf (through a proxy), Baton's streams on both; the hub sourcing the
    site's outbox when `linked`. Everything is stopped on the way out, failure or not."""
    async with contextlib.AsyncExitStack() as stack:
        hub = NatsServer(
            root / "hub", domain=names.HUB_DOMAIN, ws_port=0, extra_config=hub_fragment()
        )
        stack.push_async_callback(hub.stop)
        await hub.start()
        assert hub.ws_port is not None
        proxy = Proxy("127.0.0.1", hub.ws_port)
        stack.push_async_callback(proxy.stop)
        await proxy.start()
        leaf = NatsServer(
            root / "leaf", server_name=site, domain=site, extra_config=leaf_fragment([proxy.ws_url])
        )
        stack.push_async_callback(leaf.stop)
        await leaf.start()
        hub_nc = await connect(hub.url, "bench-hub", first_attempt_timeout=10)
        stack.push_async_callback(hub_nc.close)
        site_nc = await connect(leaf.url, "bench-site", first_attempt_timeout=10)
        stack.push_async_callback(site_nc.close)
        site_js = site_nc.jetstream(domain=site)
        p = Pair(hub, leaf, proxy, hub_nc, hub_nc.jetstream(), site_nc, site_js, site)
        await ensure(p.hub_js)
        await ensure_site(p.site_js, site)
        await link_up(p, timeout=30)
        if linked:
            await sites.link(p.hub_js, site, nudge=False)
            await source_active(p, timeout=30)
        yield p


async def link_up(p: Pair, timeout: float) -> float:
    """Until the hub reaches the site's JetStream API across the leaf link; the moment."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    subject = f"{sites.api_of(p.site)}.INFO"
    while True:
        try:
            await p.hub_nc.request(subject, b"", timeout=0.5)
            return time.perf_counter()
        except (TimeoutError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
            pass
        if loop.time() > deadline:
            raise TimeoutError(f"the leaf did not link to the hub within {timeout:g} s")
        await asyncio.sleep(POLL_S)


async def source_active(p: Pair, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        state = (await sites.source_states(p.hub_nc, names.EVENTS_STREAM)).get(sites.api_of(p.site))
        if state is not None and state.active:
            return
        if loop.time() > deadline:
            raise TimeoutError(f"the hub's source of {p.site} not active within {timeout:g} s")
        await asyncio.sleep(0.05)


async def publish(p: Pair, n: int, window: int) -> tuple[float, float]:
    """N events at the site, `window` in flight, each acknowledged by the outbox;
    (first publish, last ack) as perf_counter moments."""
    subject = names.at_site(names.event_subject(RUN, "progress"), p.site)
    sem = asyncio.Semaphore(window)
    last = 0.0

    async def one(i: int) -> None:
        nonlocal last
        try:
            ack = await p.site_js.publish(subject, (b"%010d|" % i).ljust(PAYLOAD_BYTES, b"x"))
            if ack.stream != names.OUTBOX_STREAM:
                raise RuntimeError(f"event {i} acked by {ack.stream}, not the outbox")
            last = max(last, time.perf_counter())
        finally:
            sem.release()

    start = time.perf_counter()
    tasks = []
    try:
        for i in range(1, n + 1):
            await sem.acquire()
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return start, last


async def hub_count(p: Pair) -> int:
    return (await p.hub_js.stream_info(names.EVENTS_STREAM)).state.messages


async def arrival(p: Pair, n: int, timeout: float) -> tuple[float | None, float | None, int]:
    """Poll the hub's events stream until it holds `n` messages: (first seen, all seen) as
    perf_counter moments (None if not within `timeout`), and the count seen last."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    first: float | None = None
    count = 0
    while loop.time() < deadline:
        count = await hub_count(p)
        now = time.perf_counter()
        if count and first is None:
            first = now
        if count >= n:
            return first, now, count
        await asyncio.sleep(POLL_S)
    return first, None, count


async def verify(p: Pair, r: Result) -> None:
    """Exactly the outbox's events at the hub, once each, in the outbox's order; also after
    a moment's settling (a late duplicate would show then)."""
    await asyncio.sleep(0.5)
    outbox = await stored(p.site_nc, names.OUTBOX_STREAM, names.site_root(p.site, "events"))
    hub = await stored(p.hub_nc, names.EVENTS_STREAM, names.EVENTS_ALL)
    want_subject = names.event_subject(RUN, "progress")
    problems = []
    if len(outbox) != r.events:
        problems.append(f"outbox holds {len(outbox)}, not {r.events}")
    if len({d for _, d in hub}) != len(hub):
        problems.append(f"{len(hub) - len({d for _, d in hub})} duplicates at the hub")
    if len(hub) != r.events:
        problems.append(f"hub holds {len(hub)}, not {r.events}")
    if any(s != want_subject for s, _ in hub):
        problems.append("unexpected subjects at the hub")
    if [d for _, d in hub] != [d for _, d in outbox]:
        problems.append("hub order differs from the outbox's")
    r.arrived = len(hub)
    if problems:
        r.ok = False
        r.problem = "; ".join(problems)


async def live(root: Path, a: argparse.Namespace) -> Result:
    async with pair(root, a.site, linked=True) as p:
        start, last_ack = await publish(p, a.events, a.window)
        _, done, count = await arrival(p, a.events, a.timeout)
        r = Result("live (link up)", "-", "first publish", None, a.events, count)
        if done is not None:
            r.seconds = done - start
            r.lag_s = max(0.0, done - last_ack)
        r.publish_rate = a.events / (last_ack - start)
        await verify(p, r)
        return r


async def drain(root: Path, a: argparse.Namespace) -> Result:
    async with pair(root, a.site, linked=False) as p:
        await publish(p, a.events, a.window)
        t0 = time.perf_counter()
        await sites.link(p.hub_js, a.site, nudge=False)
        first, done, count = await arrival(p, a.events, a.timeout)
        r = Result("backlog, link up", "-", "source attach", None, a.events, count)
        if done is not None:
            r.seconds = done - t0
        if first is not None:
            r.first_s = first - t0
        await verify(p, r)
        return r


async def cut(root: Path, a: argparse.Namespace, cut_s: float, nudge: bool) -> Result:
    async with pair(root, a.site, linked=True) as p:
        severed = time.perf_counter()
        p.proxy.sever()
        await publish(p, a.events, a.window)
        await asyncio.sleep(max(0.0, severed + cut_s - time.perf_counter()))
        p.proxy.restore()
        restored = time.perf_counter()
        up = await link_up(p, timeout=30)
        if nudge:
            await sites.link(p.hub_js, a.site, nudge=True)
        first, done, count = await arrival(p, a.events, a.timeout)
        r = Result(f"cut {cut_s:g} s", "yes" if nudge else "no", "link-up", None, a.events, count)
        r.cut_s = restored - severed
        r.relink_s = up - restored
        if done is not None:
            r.seconds = done - up
        if first is not None:
            r.first_s = first - up
        await verify(p, r)
        return r


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[Result], base: Result) -> str:
    head = (
        f"{'measurement':<18} {'nudged':>6} {'from':>13} {'to last event s':>15}"
        f" {'events/s':>9} {'÷ live':>7} {'to first s':>10} {'relink s':>8} {'check':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r.rate / base.rate if r.rate and base.rate else None
        seconds = "timeout" if r.seconds is None else f"{r.seconds:.3f}"
        lines.append(
            f"{r.label:<18} {r.nudged:>6} {r.since:>13} {seconds:>15}"
            f" {fmt(r.rate, '.0f'):>9} {fmt(ratio, '.2f'):>7} {fmt(r.first_s, '.3f'):>10}"
            f" {fmt(r.relink_s, '.2f'):>8} {'ok' if r.ok else 'FAIL':>5}"
        )
    return "\n".join(lines)


async def main(a: argparse.Namespace) -> int:
    # SIGTERM (a `timeout`, a CI runner) unwinds like Ctrl-C: every server and proxy stopped.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    cuts = [float(c) for c in a.cuts.split(",") if c]
    if a.no_compare:
        compare: list[float] = []
    elif a.compare_no_nudge is not None:
        compare = [float(c) for c in a.compare_no_nudge.split(",") if c]
    else:  # the cut nearest 30 s: long enough for the back-off to show, short enough to wait
        compare = [min(cuts, key=lambda c: abs(c - 30))] if cuts else []
    plan = [(c, True) for c in cuts] + [(c, False) for c in compare]
    estimate = sum(c for c, _ in plan) + 3 * (len(plan) + 2)
    print(
        f"{a.events} events of {PAYLOAD_BYTES} B, window {a.window}; cuts {cuts}, without "
        f"nudge {compare}; at least {estimate:.0f} s, plus the back-off after cuts without "
        "the nudge",
        flush=True,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        root = Path(tmp)
        steps: list[tuple[str, object]] = [("live", None), ("drain", None)]
        steps += [("cut", step) for step in plan]
        for i, (kind, arg) in enumerate(steps):
            where = root / str(i)
            if kind == "live":
                r = await live(where, a)
            elif kind == "drain":
                r = await drain(where, a)
            else:
                assert isinstance(arg, tuple)
                r = await cut(where, a, *arg)
            results.append(r)
            extra = f" (cut lasted {r.cut_s:.2f} s)" if r.cut_s is not None else ""
            status = "ok" if r.ok else f"FAIL: {r.problem}"
            print(
                f"  {r.label}, nudged {r.nudged}: {fmt(r.seconds, '.3f')} s from {r.since}"
                f"{extra}; {r.arrived}/{r.events} at the hub; {status}",
                flush=True,
            )
    base = results[0]
    print()
    print(table(results, base))
    print(
        f"\nlive: publish {fmt(base.publish_rate, '.0f')} events/s (acked by the outbox), "
        f"last ack → last event at the hub {fmt(base.lag_s, '.3f')} s"
    )
    return 0 if all(r.ok and r.seconds is not None for r in results) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--events", type=int, default=10000, help="events buffered per cut")
    ap.add_argument("--cuts", default="5,30,120", help="cut lengths in seconds")
    ap.add_argument(
        "--compare-no-nudge",
        default=None,
        metavar="CUTS",
        help="cut lengths to measure again without the nudge (default: the cut nearest 30 s)",
    )
    ap.add_argument("--no-compare", action="store_true", help="measure no cut without nudge")
    ap.add_argument("--window", type=int, default=256, help="publishes in flight at the site")
    ap.add_argument("--site", default="bench", help="the site's name (its JetStream domain)")
    ap.add_argument(
        "--timeout", type=float, default=180.0, help="give up waiting for the hub after this"
    )
    try:
        raise SystemExit(asyncio.run(main(ap.parse_args())))
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise SystemExit(130) from None
