"""What the dashboard's pages show, as JSON-ready data: a run (its timeline, goodput and loss
curves, computed by the same code as `baton report`), workers, sites, streams, dead letters.

Every read the dashboard makes from NATS on a request's behalf goes through `Reads`, which
counts it: the runs list must cost the page, not the history, and a test holds it to that.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from baton.cli import inspect, reader
from shared.bus import names, sourcing
from shared.contracts import RunRecord, decode
from shared.contracts import events as ev
from shared.contracts.events import Event, kind_of
from shared.errors import ContractError
from shared.history.goodput import goodput
from shared.history.timeline import attempts_of
from shared.state.runs import Runs
from shared.state.workers import live_workers

MAX_POINTS = 2000
"""Loss points per attempt sent to a browser: a long run's curve is thinned to this."""


@dataclass
class Reads:
    """Messages and entries read from NATS for browsers, since the server started."""

    count: int = 0


class RunEvents:
    """A run's events from the first, then live: what a run page is built from."""

    def __init__(self, nc: Client, run_id: str, reads: Reads) -> None:
        self.nc = nc
        self.run_id = run_id
        self.reads = reads
        self.events: list[Event] = []
        self.seq = 0
        """The events stream's sequence of the newest event read."""
        self._sub: reader.StreamReader | None = None

    async def __aenter__(self) -> RunEvents:
        subject = names.events_of_run(self.run_id)
        self._sub = await reader.read(self.nc, names.EVENTS_STREAM, subject)
        for msg in await reader.drain(self._sub, idle_s=0.5):
            self._add(msg)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def more(self, timeout: float) -> bool:
        """Wait up to `timeout` for the next event, then take every one already there.
        False if none came."""
        assert self._sub is not None
        try:
            self._add(await self._sub.next_msg(timeout=timeout))
        except TimeoutError:
            return False
        with contextlib.suppress(TimeoutError):
            while True:
                self._add(await self._sub.next_msg(timeout=0.01))
        return True

    def _add(self, msg: Msg) -> None:
        self.reads.count += 1
        self.seq = msg.metadata.sequence.stream
        with contextlib.suppress(ContractError):  # an event from a newer Baton: skip it
            self.events.append(decode(msg.data, Event))


def run_view(record: RunRecord, events: list[Event], seq: int) -> dict[str, Any]:
    """A run page: the record, its attempts on a timeline, the marks on it, loss curves."""
    attempts = attempts_of(events) if events else []
    rows = []
    for a in attempts:
        rows.append({
            "index": a.index, "attempt": a.started.attempt, "worker": a.started.worker,
            "token": a.started.token, "row": a.row, "outcome": a.outcome,
            "start": a.started.at, "end": a.end_at, "alive_until": a.alive_until,
            "first_step": a.first_step, "last_step": a.last_step,
            "resumed_from": a.resumed.step if a.resumed else None, "redone": a.redone,
            "commits": [(c.step, c.at) for c in a.commits],
            "loss": _thin(a.steps, a.losses),
        })  # fmt: skip
    spent = goodput(events)
    return {
        "seq": seq,
        "record": _record(record),
        "goodput": spent.as_dict() if spent else None,
        "attempts": rows,
        "marks": [_mark(e) for e in events if _marked(e)],
        "now": time.time(),
    }


def _thin(steps: list[int], losses: list[float]) -> list[tuple[int, float | None]]:
    stride = max(1, math.ceil(len(steps) / MAX_POINTS))
    keep = list(range(0, len(steps), stride))
    if steps and keep[-1] != len(steps) - 1:
        keep.append(len(steps) - 1)
    return [(steps[i], None if math.isnan(losses[i]) else losses[i]) for i in keep]


MARKED = (
    ev.Accepted, ev.Started, ev.Restored, ev.Preempted, ev.AttemptFailed, ev.Fenced,
    ev.HandedOver, ev.Redispatched, ev.RunWarning, ev.CommitRefused, ev.Diverged,
    ev.GroupFormed, ev.RankLost, ev.Resized,
    ev.Completed, ev.Failed, ev.Cancelled,
)  # fmt: skip


def _marked(e: Event) -> bool:
    return isinstance(e, MARKED)


def _mark(e: Event) -> dict[str, Any]:
    detail = {
        k: v for k, v in inspect.as_json(e).items() if k not in ("type", "run_id", "at")
    }
    return {"kind": kind_of(e), "at": e.at, "detail": detail}


def _record(r: RunRecord) -> dict[str, Any]:
    out: dict[str, Any] = inspect.as_json(r)
    out["spec"] = {
        "name": r.spec.name, "pool": r.spec.pool, "total_steps": r.spec.total_steps,
        "entry_point": r.spec.entry_point,
    }  # fmt: skip
    return out


class Goodputs:
    """Finished runs' goodput, computed once: it cannot change any more."""

    def __init__(self, nc: Client, reads: Reads, keep: int = 10_000) -> None:
        self.nc = nc
        self.reads = reads
        self.keep = keep
        self._done: dict[str, dict[str, Any] | None] = {}

    async def of(self, run_id: str) -> dict[str, Any] | None:
        if run_id in self._done:
            return self._done[run_id]
        async with RunEvents(self.nc, run_id, self.reads) as history:
            spent = goodput(history.events)
        found = spent.as_dict() if spent else None
        if spent is not None and spent.finished:
            if len(self._done) >= self.keep:
                self._done.pop(next(iter(self._done)))
            self._done[run_id] = found
        return found


async def run_record(nc: Client, run_id: str, reads: Reads) -> RunRecord | None:
    """The run's record; once the runs bucket forgot a retired run, its archived one."""
    reads.count += 1
    return await (await Runs.open(nc.jetstream())).find(run_id)


async def workers(nc: Client, reads: Reads) -> list[Any]:
    found = await live_workers(nc.jetstream())
    reads.count += len(found)
    return [inspect.as_json(w) for w in found]


async def sites(nc: Client, reads: Reads) -> list[Any]:
    found = await sourcing.views(nc)
    reads.count += len(found)
    return [inspect.as_json(v) for v in found]


async def streams(nc: Client, reads: Reads) -> list[Any]:
    found = await inspect.streams(nc, None)
    reads.count += len(found)
    return [inspect.as_json(s) for s in found]


async def letters(nc: Client, reads: Reads) -> list[dict[str, Any]]:
    found = await inspect.dlq(nc)
    reads.count += len(found)
    return [
        {
            "seq": f.seq, "reason": f.letter.reason, "subject": f.letter.subject,
            "source": f.letter.source, "at": f.letter.at, "delivered": f.letter.delivered,
            "preview": inspect.payload_text(f.letter.payload)[:2000],
        }
        for f in found
    ]  # fmt: skip


async def log_tail(nc: Client, run_id: str, reads: Reads) -> AsyncIterator[str]:
    """The run's captured output from the start, then live."""
    async for chunk in inspect.log_chunks(nc, run_id, follow=True):
        reads.count += 1
        yield chunk.decode(errors="replace")
