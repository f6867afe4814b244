"""The dashboard's view of every run: one summary per run, kept current by watching the runs
bucket, so listing a page reads nothing from NATS however long the history is.

The watch delivers each run's newest record once when it starts, then every change as it is
written. A summary is a few hundred bytes (no spec, no metrics), so a history of 100,000
runs holds tens of megabytes here, and a page is a slice of an index sorted by creation —
its cost is the page, not the history. Every change also goes to the browsers following the
list (`live.Fanout`), each numbered by the bucket's stream sequence so that a browser that
reconnects is sent exactly what changed since the last change it saw.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from baton.client.inspect import as_json
from baton.ui.live import Fanout
from shared.bus import names
from shared.bus.follow import Following
from shared.contracts import RunRecord, RunState, decode
from shared.errors import ContractError
from shared.state.clock import ServerClock, created

log = logging.getLogger("baton.ui")

MAX_PAGE = 200


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the runs list shows of a run."""

    run_id: str
    name: str
    state: RunState
    step: int
    """The newest committed checkpoint's step."""
    total_steps: int
    attempts: int
    worker: str | None
    pool: str
    owner: str
    site: str
    """The site holding the run's grant, else the one it ended at ("" for the hub)."""
    created_at: float
    updated_at: float
    seq: int
    """The runs bucket's stream sequence of the record this summary was made from."""
    stamped_at: float = 0.0
    """The hub server's stamp of that record (its clock): how long ago the run last changed
    is the hub's now less this. `created_at` and `updated_at` are their writers' clocks,
    shown and never subtracted from another's."""

    @classmethod
    def of(cls, r: RunRecord, seq: int, stamped_at: float) -> RunSummary:
        return cls(
            run_id=r.run_id, name=r.spec.name, state=r.state, step=r.step,
            total_steps=r.spec.total_steps, attempts=r.attempts, worker=r.worker,
            pool=r.spec.pool, owner=r.run_id.rpartition(".")[0], site=r.site or r.ending_site,
            created_at=r.created_at, updated_at=r.updated_at, seq=seq, stamped_at=stamped_at,
        )  # fmt: skip


class Filter(msgspec.Struct, frozen=True, kw_only=True):
    state: str = ""
    pool: str = ""
    owner: str = ""
    site: str = ""

    def admits(self, s: RunSummary) -> bool:
        return (
            (not self.state or s.state.value == self.state.upper())
            and (not self.pool or s.pool == self.pool)
            and (not self.owner or s.owner == self.owner)
            and (not self.site or s.site == self.site)
        )


@dataclass
class Page:
    runs: list[RunSummary]
    next: str | None
    """The cursor of the next (older) page, None on the last one."""
    total: int
    """Runs in the index, all filters aside."""


@dataclass
class RunIndex:
    js: JetStreamContext
    fanout: Fanout
    clock: ServerClock
    runs: dict[str, RunSummary] = field(default_factory=dict)
    _order: list[tuple[float, str]] = field(default_factory=list)  # (-created_at, run_id)
    following: Following = field(init=False)

    def __post_init__(self) -> None:
        self.following = Following(self.js, names.RUNS_BUCKET, self._entry)

    def _entry(self, entry: KeyValue.Entry) -> None:
        assert entry.value is not None and entry.revision is not None
        try:
            record = decode(entry.value, RunRecord)
            stamped_at = created(entry)
        except (ContractError, ValueError) as exc:
            log.warning("unreadable run record %s: %s", entry.key, exc)
            return
        self._put(RunSummary.of(record, entry.revision, stamped_at))

    def _put(self, s: RunSummary) -> None:
        if s.run_id not in self.runs:
            bisect.insort(self._order, (-s.created_at, s.run_id))
        self.runs[s.run_id] = s
        self.fanout.publish("run", self.shown(s), s.seq)

    def shown(self, s: RunSummary) -> dict[str, Any]:
        """A summary as a browser is sent it, with the hub's time now (`now`, the server's
        clock, as `stamped_at` is): the page ages it by that clock, never its own; and the
        runs in the index when it was sent (`total`: the list's count, which only grows)."""
        return {**as_json(s), "now": self.clock.now(), "total": len(self.runs)}

    def page(self, where: Filter, after: tuple[float, str] | None, limit: int) -> Page:
        """Up to `limit` runs admitted by `where`, in the list's one order — newest first by
        `created_at`, a tie by run id, ascending (the page keeps the same order as changes
        come) — that come after the cursor `after` (a previous page's `next`, parsed:
        `params.cursor`)."""
        limit = max(1, min(limit, MAX_PAGE))
        start = 0
        if after is not None:
            at, run_id = after
            start = bisect.bisect_right(self._order, (-at, run_id))
        out: list[RunSummary] = []
        i = start
        for i in range(start, len(self._order)):
            s = self.runs[self._order[i][1]]
            if where.admits(s):
                out.append(s)
                if len(out) == limit:
                    break
        more = len(out) == limit and i + 1 < len(self._order)
        cursor = f"{out[-1].created_at!r}:{out[-1].run_id}" if more and out else None
        return Page(runs=out, next=cursor, total=len(self.runs))

    def since(self, seq: int) -> list[RunSummary]:
        """Summaries changed after the bucket's stream sequence `seq`, oldest change first."""
        return sorted((s for s in self.runs.values() if s.seq > seq), key=lambda s: s.seq)
