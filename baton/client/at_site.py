"""What the CLI reads when it is pointed at a site's leaf node (docs/sites.md, "Seeing a
site while cut off"): which site it is at, whether the hub answers from there, and the
site's own view — the runs granted to it (its own runs bucket), its trainers (their
heartbeats in its outbox) — which is there with the link cut."""

from __future__ import annotations

import contextlib
import sys

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from baton.client import reader
from baton.client.errors import needs
from shared.bus import names
from shared.contracts import RunRecord, decode
from shared.contracts.control import WorkerInfo
from shared.errors import ContractError
from shared.state import archive
from shared.state.runs import Runs


def site_of(nc: Client) -> str:
    """The JetStream domain of the server `nc` is connected to when it is a site's leaf node
    (not the hub's domain); "" at the hub."""
    domain = str(getattr(nc, "_server_info", {}).get("domain") or "")
    return "" if domain == names.HUB_DOMAIN else domain


def hub_domain(nc: Client) -> str | None:
    """The domain a read of the hub's state goes to: the hub's from a site's leaf node (the
    site's users may read the runs bucket across the link), else the server's own."""
    return names.HUB_DOMAIN if site_of(nc) else None


async def hub_answers(nc: Client, timeout: float = 2.0) -> bool:
    """Whether the hub's JetStream answers from here (across a site's link, which carries
    `$JS.hub.API.INFO` for the site's users)."""
    try:
        await nc.request(f"$JS.{names.HUB_DOMAIN}.API.INFO", b"", timeout=timeout)
    except Exception:
        return False
    return True


def note(text: str) -> None:
    """A line on stderr beside a command's answer: what the answer leaves out."""
    print(f"note: {text}", file=sys.stderr)


async def site_record(nc: Client, site: str, run_id: str) -> RunRecord | None:
    try:
        runs = await Runs.open(nc.jetstream(), bucket=names.site_runs_bucket(site))
    except NotFoundError:  # a site from before grants
        return None
    found = await runs.get(run_id)
    return found[0] if found is not None else None


async def site_records(nc: Client, site: str, history: bool) -> list[RunRecord]:
    """At a site: the runs granted to it, from its own bucket (there with the link cut),
    and the hub's records of the others when the hub answers; a note on stderr when it
    does not."""
    kept: dict[str, RunRecord] = {}
    with contextlib.suppress(NotFoundError):
        own = await Runs.open(nc.jetstream(), bucket=names.site_runs_bucket(site))
        kept = {r.run_id: r for r in await own.all()}
    if await hub_answers(nc):
        js = nc.jetstream(domain=names.HUB_DOMAIN)
        with needs("runs bucket"):
            at_hub = await (await Runs.open(js)).all()
            if history:
                with needs("archive"):
                    at_hub += await archive.records(js)
        for r in at_hub:
            # The site's own record of a run it holds is the newer one.
            if r.run_id not in kept or r.site != site:
                kept[r.run_id] = r
    else:
        note(f"the hub is unreachable from this site (cut off?): site {site}'s own runs only")
    return sorted(kept.values(), key=lambda r: r.created_at)


async def site_workers(nc: Client, site: str) -> list[tuple[WorkerInfo, float]]:
    """At a site: its own trainers, from their newest heartbeats in the site's outbox
    (each expires there as at the hub), with how long ago the site's server stored each."""
    from shared.state.clock import age, server_now, stamp

    subject = names.site_root(site, "workers")
    out = []
    with needs("the site's outbox"):
        sub = await reader.read(nc, names.OUTBOX_STREAM, subject)
        try:
            msgs = await reader.drain(sub)
        finally:
            await sub.unsubscribe()
        if not msgs:
            return []
        now = await server_now(nc, names.OUTBOX_STREAM)
    newest = {m.subject: m for m in msgs}
    for m in sorted(newest.values(), key=lambda m: m.subject):
        with contextlib.suppress(ContractError):
            seen = age(now, stamp(m.metadata.timestamp)) if m.metadata else 0.0
            out.append((decode(m.data, WorkerInfo), seen))
    return out
