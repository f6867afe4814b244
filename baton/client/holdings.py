"""What each site holds, as `baton sites` shows it: the live runs granted to it, and the
seconds of expected work they come to per live trainer there (its granted horizon).

Invariant: the same reckoning the scheduler grants by (`shared.scheduling.horizon`): each
run's steps left (its record's committed step) times its job's measured median seconds
per step, else its `estimate_s` for those steps, times its ranks; runs nobody can
estimate are counted apart (`unestimated`), never guessed.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError

from baton.client import calls as client
from shared.bus import names
from shared.bus import sourcing as site_links
from shared.contracts import decode
from shared.scheduling.horizon import Work, expected_s
from shared.state.pools import JobSpeeds, job_key, median
from shared.state.workers import live_workers


async def site_views(nc: Any) -> list[site_links.SiteView]:
    """Every site the hub heard from, with what it holds."""
    found = await site_links.views(nc)
    live = [r for r in await client.all_records(nc) if r.site and not r.state.terminal]
    js = nc.jetstream()
    trainers = Counter(w.site for w in await live_workers(js) if w.site)
    kv = await js.key_value(names.POOLS_BUCKET)
    speeds: dict[tuple[str, str], float | None] = {}
    held: Counter[str] = Counter()
    held_s: dict[str, float] = defaultdict(float)
    unknown: Counter[str] = Counter()
    for r in live:
        held[r.site] += 1
        key = (r.spec.pool, r.spec.name)
        if key not in speeds:
            speeds[key] = None
            with contextlib.suppress(KeyNotFoundError):
                entry = await kv.get(job_key(*key))
                speeds[key] = median(decode(entry.value or b"", JobSpeeds).samples)
        known = {r.spec.name: s} if (s := speeds[key]) is not None else {}
        work = Work(
            job=r.spec.name, steps=r.spec.total_steps - r.step, total_steps=r.spec.total_steps,
            estimate_s=r.spec.estimate_s, ranks=r.spec.max_ranks,
        )  # fmt: skip
        e = expected_s(work, known)
        if e is None:
            unknown[r.site] += 1
        else:
            held_s[r.site] += e
    out = []
    for v in found:
        n = trainers[v.site]
        out.append(msgspec.structs.replace(
            v, held=held[v.site], held_s=held_s[v.site], trainers=n,
            horizon_s=held_s[v.site] / n if n else None, unestimated=unknown[v.site],
        ))  # fmt: skip
    return out
