"""How busy a site's trainers were, read off the site's own events (its outbox), never off
the test's clock: each attempt counts from its `started` to its last `progress` or
`checkpoint_committed` before its end — not to the end event itself, which a run held by
the hub publishes only once its record is written, after the link is back.
"""

from __future__ import annotations

from shared.bus import names
from shared.contracts import decode
from shared.contracts.events import Event, Started
from tests.support.sites import Site

ENDS = ("completed", "fenced", "failed", "attempt_failed", "preempted", "cancelled", "paused")


async def site_events(site: Site) -> list[tuple[str, Event]]:
    """(kind, event) of every event the site's outbox holds, in order."""
    out = []
    for subject, data in await site.outbox(names.site_root(site.name, "events")):
        out.append((subject.rsplit(".", 1)[1], decode(data, Event)))
    return out


def busy_within(events: list[tuple[str, Event]], start: float, end: float) -> float:
    """Trainer-seconds inside [start, end] (the site's clock) spent training."""
    total = 0.0
    for i, (kind, e) in enumerate(events):
        if kind != "started" or not isinstance(e, Started):
            continue
        stop = e.at
        for later_kind, later in events[i + 1 :]:
            if later.run_id != e.run_id:
                continue
            if later_kind in ENDS:
                break
            if later_kind in ("progress", "checkpoint_committed"):
                stop = later.at
        total += max(0.0, min(stop, end) - max(e.at, start))
    return total
