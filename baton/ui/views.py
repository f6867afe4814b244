"""What the dashboard's pages show, as JSON-ready data: a run (its timeline, goodput and loss
curves, computed by the same code as `baton report`), workers, sites, streams, dead letters.

Every time a page subtracts is the hub server's (docs/architecture.md, "Clocks"): a run's
events are put on the hub's clock from their stamps (`shared.history.clocks`) before its
timeline and goodput are computed, and everything a page shows an age of comes with the
server's stamp of it (`stamped_at`) and the hub's time when it was sent (`now`). A writer's
own time (`at`, `created_at`) is shown as written, never subtracted.

Every read the dashboard makes from NATS on a request's behalf goes through `Reads`, which
counts it: the runs list must cost the page, not the history, and a test holds it to that.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from baton.client import inspect, reader
from baton.ui import params
from baton.ui.live import heard
from baton.ui.vitals import vitals
from shared.bus import names
from shared.contracts import RunRecord, decode
from shared.contracts import events as ev
from shared.contracts.events import Event, kind_of
from shared.contracts.letters import DeadLetter
from shared.errors import ContractError
from shared.history.clocks import on_hub_clock
from shared.history.goodput import goodput
from shared.history.timeline import attempts_of
from shared.state.clock import stamp
from shared.state.runs import Runs
from shared.state.workers import heard_workers

MAX_POINTS = 2000
"""Loss points per attempt sent to a browser: a long run's curve is thinned to this."""


@dataclass
class Reads:
    """Messages and entries read from NATS for browsers, since the server started."""

    count: int = 0


class RunEvents:
    """A run's events from the first, then live: what a run page is built from. Invariant:
    `stamps[i]` is the hub server's stamp of `events[i]`."""

    def __init__(self, nc: Client, run_id: str, reads: Reads) -> None:
        self.nc = nc
        self.run_id = run_id
        self.reads = reads
        self.events: list[Event] = []
        self.stamps: list[float] = []
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
            event = decode(msg.data, Event)
            self.events.append(event)
            self.stamps.append(stamp(msg.metadata.timestamp))

    def on_hub_clock(self) -> list[Event]:
        """The events so far, each `at` on the hub's clock: computed again from all of them
        each time, since a later event may show a publisher's clock better."""
        return on_hub_clock(self.events, self.stamps)


def run_view(
    record: RunRecord, events: list[Event], stamps: list[float], seq: int, now: float
) -> dict[str, Any]:
    """A run page: the record, its attempts on a timeline, the marks on it, loss curves,
    and what an operator watches (`vitals`: hold, lineage, guard, stalls, risk, recoveries).
    `stamps` are the server's stamps of `events`, and `now` the hub's time: the timeline,
    goodput and ages are all on the hub's clock, whatever its publishers' clocks say."""
    events = on_hub_clock(events, stamps)
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
    # A live run lasts until now; a finished one whose ending is not stored, until its last.
    spent = goodput(events, None if record.state.terminal else now)
    accepted = next((e.at for e in events if isinstance(e, ev.Accepted)), None)
    return {
        "seq": seq,
        "record": _record(record),
        "goodput": spent.as_dict() if spent else None,
        "attempts": rows,
        "marks": [_mark(e) for e in events if _marked(e)],
        "accepted_at": accepted,
        "ending": ending(record, events),
        "vitals": vitals(record, events),
        "now": now,
    }


ENDINGS = (ev.Completed, ev.Failed, ev.Cancelled)


def ending(record: RunRecord, events: list[Event]) -> dict[str, Any] | None:
    """How the run ended, shown at the top of its page: None while its record is not
    terminal. Invariant: it says what the record says (its state, and its reason for a
    failed or cancelled run), with the time, step and detail of its terminal event when that
    event is stored — `at` on the hub's clock, as `events` are here."""
    if not record.state.terminal:
        return None
    kind = record.state.value.lower()
    ends = (e for e in reversed(events) if isinstance(e, ENDINGS) and kind_of(e) == kind)
    last = next(ends, None)
    return {
        "kind": kind,
        "state": record.state.value,
        "reason": record.reason or getattr(last, "reason", "") or "",
        "detail": getattr(last, "detail", "") or "",
        "step": record.step,
        "at": last.at if last is not None else None,
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
    ev.GroupFormed, ev.RankLost, ev.Resized, ev.StallRecovered, ev.Guarded, ev.Paused,
    ev.Resumed, ev.RolledBack, ev.Forked,
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
            spent = goodput(history.on_hub_clock())
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


async def workers(nc: Client, reads: Reads, now: float) -> list[Any]:
    """Live trainers, each with the server's stamp of its newest heartbeat and `now`."""
    found = await heard_workers(nc.jetstream())
    reads.count += len(found)
    return [heard(h.info, h.at, now) for h in found]


async def streams(nc: Client, reads: Reads) -> list[Any]:
    found = await inspect.streams(nc, None)
    reads.count += len(found)
    return [inspect.as_json(s) for s in found]


PREVIEW_CHARS = 1000
"""A letter's payload shown on its page, at most (`baton dlq show` prints it whole)."""


async def letters(
    nc: Client, reads: Reads, now: float, after: int = 0, limit: int = params.LETTERS_PAGE
) -> dict[str, Any]:
    """A page of dead letters costs the page: one stream info and at most `limit` + 1
    message gets, however many letters the stream holds or were replayed (deleted), since
    each get asks for the first letter at or after a sequence (`next_by_subj`), skipping
    every gap at once. Oldest first: by sequence in the dead-letter stream, the order they
    were stored in.

    `letters`: up to `limit` with a sequence above `after` (0: from the first), each with
    the server's stamp of it (`stamped_at`: when the hub stored it; its `at` is its writer's
    clock, shown); `next`: the cursor of the next page (its last letter's sequence), None
    on the last page; `total`: the letters the stream holds now; `now`: the hub's time."""
    js = nc.jetstream()
    page: dict[str, Any] = {"letters": [], "next": None, "total": 0, "now": now}
    try:
        info = await js.stream_info(names.DLQ_STREAM)
    except NotFoundError:
        return page
    reads.count += 1
    page["total"] = info.state.messages
    out: list[dict[str, Any]] = page["letters"]
    seq = after + 1
    while seq <= info.state.last_seq:
        try:
            msg = await js.get_msg(names.DLQ_STREAM, seq, subject=names.DLQ_ALL, next=True)
        except NotFoundError:  # none left at or after `seq` (replayed meanwhile)
            break
        reads.count += 1
        if len(out) == limit:  # one more exists: this page is not the last
            page["next"] = out[-1]["seq"]
            break
        assert msg.seq is not None, "a stored message has a sequence"
        out.append(_letter(msg.seq, msg.data or b"", stamp(msg.time)))
        seq = msg.seq + 1
    return page


def _letter(seq: int, data: bytes, stamped_at: float) -> dict[str, Any]:
    """One letter as its page shows it; one this Baton cannot read is listed as such."""
    try:
        letter = decode(data, DeadLetter)
    except ContractError as exc:
        letter = DeadLetter(
            source="?", subject="?", reason=f"unreadable dead letter: {exc}", payload=data,
            headers={}, stream_seq=0, delivered=0, at=stamped_at,
        )  # fmt: skip
    return {
        "seq": seq, "reason": letter.reason, "subject": letter.subject,
        "source": letter.source, "at": letter.at, "delivered": letter.delivered,
        "preview": inspect.payload_text(letter.payload)[:PREVIEW_CHARS],
        "stamped_at": stamped_at,
    }  # fmt: skip


async def log_tail(nc: Client, run_id: str, reads: Reads) -> AsyncIterator[str]:
    """The run's captured output from the start, then live."""
    async for chunk in inspect.log_chunks(nc, run_id, follow=True):
        reads.count += 1
        yield chunk.decode(errors="replace")
