"""A run's events put on one clock, the hub's, before anything subtracts their times.

Invariant: every `at` that `on_hub_clock` returns is on the hub's JetStream server clock and
is no later than the server's stamp of that event (nothing is placed after the hub stored
it); two events one publisher wrote are exactly as far apart as its own clock said; and
no difference of two returned times carries any host's clock error.

Why neither time alone will do. An event's `at` is its publisher's wall clock: a trainer
5 minutes ahead writes times 5 minutes ahead, and subtracting the dispatcher's `accepted`
from it gives a phantom 5 minutes. The hub's stamp (`stamps`, from the stream's metadata)
is one clock, but it is the hub's *receipt*: a site's events are stamped when the hub
sources them from the site's outbox, so after a cut, minutes of a site's training arrive
stamped within the same second.

Both together: for each publisher, `stamp − at` is its clock's offset from the hub's plus
how long that event took to get there, never less than the offset. Its smallest value over
the publisher's events — the one that got there fastest, a live event takes milliseconds —
is the offset, to within that delay; each of its events is placed at `at + offset`. A
publisher whose every event was held back (all its events sat out a cut) is placed as late
as they arrived allow: the same spacing, never later than the hub heard of them.

Publishers are told apart by the trainer (`worker`) events name, one per attempt (a worker
id may come back on another host); an event whose writer cannot be told — the
dispatcher's, the checkpointer's, the reaper's, a `handed_over` (its `worker` is the dead
attempt, not its writer) — is placed at its stamp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec

from shared.contracts import decode
from shared.contracts import events as ev
from shared.contracts.events import Event
from shared.errors import ContractError

if TYPE_CHECKING:
    from nats.aio.msg import Msg

Publisher = tuple[str, int]
"""(worker, how many `started` of that worker came before): one trainer's attempt."""


def publishers(events: Sequence[Event]) -> list[Publisher | None]:
    """Who wrote each event, where the events tell: a trainer's attempt; None otherwise."""
    out: list[Publisher | None] = []
    starts: dict[str, int] = {}
    for e in events:
        worker = "" if isinstance(e, ev.HandedOver) else str(getattr(e, "worker", "") or "")
        if not worker:
            out.append(None)
            continue
        if isinstance(e, ev.Started):
            starts[worker] = starts.get(worker, 0) + 1
        out.append((worker, starts.get(worker, 0)))
    return out


def offsets(events: Sequence[Event], stamps: Sequence[float]) -> dict[Publisher, float]:
    """Each publisher's clock offset from the hub's (hub = its clock + offset): the least
    `stamp − at` over its events."""
    found: dict[Publisher, float] = {}
    for who, e, s in zip(publishers(events), events, stamps, strict=True):
        if who is not None:
            found[who] = min(found.get(who, s - e.at), s - e.at)
    return found


def on_hub_clock(events: Sequence[Event], stamps: Sequence[float]) -> list[Event]:
    """`events` (in stream order) with each `at` moved onto the hub's clock; `stamps[i]` is
    the hub server's stamp of `events[i]` (seconds since the epoch)."""
    if len(events) != len(stamps):
        raise ValueError(f"{len(events)} events but {len(stamps)} stamps")
    shift = offsets(events, stamps)
    out: list[Event] = []
    for who, e, s in zip(publishers(events), events, stamps, strict=True):
        at = s if who is None else min(s, e.at + shift[who])
        out.append(e if at == e.at else msgspec.structs.replace(e, at=at))
    return out


def from_messages(msgs: Iterable[Msg]) -> list[Event]:
    """The events of stored messages of the events stream, on the hub's clock. One that does
    not decode (a newer Baton's) is left out rather than making the history unreadable."""
    events: list[Event] = []
    stamps: list[float] = []
    for msg in msgs:
        with contextlib.suppress(ContractError):
            event = decode(msg.data, Event)
            events.append(event)
            stamps.append(msg.metadata.timestamp.timestamp())
    return on_hub_clock(events, stamps)
