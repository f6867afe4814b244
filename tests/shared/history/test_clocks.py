"""A run's events put on the hub's clock: hosts minutes off, and a site whose events sat out a
cut, give the times that really passed — and goodput without phantom minutes."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from shared.contracts import encode
from shared.contracts.events import (
    Accepted,
    CheckpointCommitted,
    Completed,
    Event,
    Fenced,
    HandedOver,
    Progress,
    Restored,
    Started,
)
from shared.history.clocks import from_messages, on_hub_clock, publishers
from shared.history.goodput import goodput

RUN = "r1"
AHEAD, BEHIND = 300.0, -300.0
LINK_S = 0.004
"""How long a prompt event takes to reach the hub."""


def progress(worker: str, first: int, last: int, t0: float) -> list[Progress]:
    return [
        Progress(run_id=RUN, step=k, total_steps=100, worker=worker, at=t0 + (k - first) * 0.1)
        for k in range(first + 10, last + 1, 10)
    ]


def true_history() -> list[Event]:
    """One kill, written on one clock (the hub's): as in test_goodput, the truth."""
    return [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=1000.0),
        Started(run_id=RUN, worker="w1", token=1, attempt=1, start_step=0, at=1001.0),
        Restored(run_id=RUN, worker="w1", step=0, at=1001.5),
        *progress("w1", 0, 40, 1001.5),
        CheckpointCommitted(run_id=RUN, step=50, token=1, manifest="m", bytes=1, at=1006.55),
        *progress("w1", 40, 80, 1005.5),
        HandedOver(run_id=RUN, worker="w1", token=1, reason="its lease expired", at=1011.0),
        Started(run_id=RUN, worker="w2", token=2, attempt=2, start_step=50, at=1012.0),
        Restored(run_id=RUN, worker="w2", step=50, at=1012.5, restore_s=0.2),
        *progress("w2", 50, 100, 1012.5),
        Completed(run_id=RUN, step=100, digest="d", at=1017.6),
    ]


def as_published(
    truth: list[Event], skew: dict[str, float], held: tuple[float, float, float] | None = None
) -> tuple[list[Event], list[float]]:
    """What the hub stores: each event's `at` on its publisher's clock (`skew` by worker;
    the hub's services and the checkpointer keep the hub's), stamped as the hub stored it —
    `held` (from, to, heal): w1's events of that span wait in a site's outbox until heal.
    In the order the hub stored them."""
    out = []
    for i, e in enumerate(truth):
        worker = getattr(e, "worker", "") if not isinstance(e, HandedOver) else ""
        stamp = e.at + LINK_S
        if held is not None and worker == "w1" and held[0] <= e.at < held[1]:
            stamp = held[2] + i * 1e-4  # sourced in the site's order, all at once
        out.append((stamp, msgspec.structs.replace(e, at=e.at + skew.get(worker, 0.0))))
    out.sort(key=lambda pair: pair[0])
    return [e for _, e in out], [s for s, _ in out]


def true_at(truth: list[Event], event: Event) -> float:
    """When `event` really happened (the one of `truth` it is, whatever its `at`)."""
    unstamped = encode(msgspec.structs.replace(event, at=0.0))
    return next(e.at for e in truth if encode(msgspec.structs.replace(e, at=0.0)) == unstamped)


def test_hosts_minutes_off_are_put_back_on_the_hubs_clock() -> None:
    truth = true_history()
    events, stamps = as_published(truth, {"w1": AHEAD, "w2": BEHIND})
    fixed = on_hub_clock(events, stamps)
    for e in fixed:
        assert e.at == pytest.approx(true_at(truth, e), abs=2 * LINK_S), e
    true_split, fixed_split = goodput(truth), goodput(fixed)
    assert true_split is not None and fixed_split is not None
    for category, seconds in true_split.seconds().items():
        assert fixed_split.seconds()[category] == pytest.approx(seconds, abs=0.02), category

    raw = goodput(events)  # what subtracting the hosts' own clocks gave: phantom minutes
    assert raw is not None and max(abs(v) for v in raw.seconds().values()) > 200, raw


def test_an_attempts_own_durations_are_its_trainers_to_the_digit() -> None:
    events, stamps = as_published(true_history(), {"w1": AHEAD, "w2": BEHIND})
    fixed = on_hub_clock(events, stamps)
    who = publishers(events)
    for i, j in ((i, j) for i in range(len(events)) for j in range(len(events))):
        if who[i] is not None and who[i] == who[j]:
            assert fixed[i].at - fixed[j].at == pytest.approx(events[i].at - events[j].at)
    assert all(e.at <= s for e, s in zip(fixed, stamps, strict=True)), "never after the hub"


def test_a_sites_events_that_sat_out_a_cut_keep_their_times() -> None:
    # w1 is at a site 5 minutes ahead; its steps 50..80 reach the hub only when the link heals,
    # after w2 (5 minutes behind) took over: their stamps are the heal's, their times are not.
    truth = true_history()
    events, stamps = as_published(truth, {"w1": AHEAD, "w2": BEHIND}, held=(1006.0, 1010.0, 1016.0))
    assert stamps == sorted(stamps)
    fixed = on_hub_clock(events, stamps)
    for e in fixed:
        assert e.at == pytest.approx(true_at(truth, e), abs=2 * LINK_S), e
    split = goodput(fixed)
    assert split is not None and split.finished
    assert sum(split.seconds().values()) == pytest.approx(split.wall_s)
    assert split.wall_s == pytest.approx(17.6, abs=0.01)
    assert all(-0.01 <= v <= split.wall_s for v in split.seconds().values()), split


def test_a_publisher_whose_every_event_was_held_back_is_placed_as_late_as_they_arrived() -> None:
    events: list[Event] = [
        Started(run_id=RUN, worker="w9", token=1, attempt=1, start_step=0, at=50.0),
        Progress(run_id=RUN, step=10, total_steps=100, worker="w9", at=53.0),
        Fenced(run_id=RUN, worker="w9", token=1, reason="taken", at=54.0),
    ]
    fixed = on_hub_clock(events, [900.0, 900.001, 900.002])
    assert [e.at for e in fixed] == pytest.approx([896.002, 899.002, 900.002])


def test_whose_events_are_told_apart() -> None:
    handed = HandedOver(run_id=RUN, worker="w1", token=1, reason="r", at=5.0)
    accepted = Accepted(run_id=RUN, name="n", pool="p", total_steps=1, at=1.0)
    first = Started(run_id=RUN, worker="w1", token=1, attempt=1, start_step=0, at=2.0)
    again = Started(run_id=RUN, worker="w1", token=3, attempt=2, start_step=0, at=9.0)
    note = Progress(run_id=RUN, step=1, total_steps=1, worker="w1", at=10.0)
    # A hand-over names the dead attempt's worker but is the reaper's (or a successor's);
    # a worker's second attempt may run on another host: a publisher of its own.
    assert publishers([accepted, first, handed, again, note]) == [
        None, ("w1", 1), None, ("w1", 2), ("w1", 2),
    ]  # fmt: skip
    fixed = on_hub_clock([accepted, handed], [7.0, 8.0])
    assert [e.at for e in fixed] == [7.0, 8.0], "whose clock is unknown: the hub's stamp"
    with pytest.raises(ValueError):
        on_hub_clock([accepted], [])


def test_stored_messages_are_read_with_their_stamps() -> None:
    def msg(event: Event, stamp: float) -> Any:
        when = datetime.datetime.fromtimestamp(stamp, datetime.UTC)
        return SimpleNamespace(data=encode(event), metadata=SimpleNamespace(timestamp=when))

    accepted = Accepted(run_id=RUN, name="n", pool="p", total_steps=1, at=100.0)
    started = Started(run_id=RUN, worker="w", token=1, attempt=1, start_step=0, at=400.0)
    newer = SimpleNamespace(data=b'{"type": "from_the_future", "run_id": "r1"}', metadata=None)
    got = from_messages([msg(accepted, 100.5), newer, msg(started, 101.0)])
    assert [type(e) for e in got] == [Accepted, Started]
    assert [e.at for e in got] == pytest.approx([100.5, 101.0])


def test_a_live_runs_now_defaults_to_its_newest_event_not_the_readers_clock() -> None:
    events: list[Event] = [
        Accepted(run_id=RUN, name="n", pool="p", total_steps=100, at=10.0),
        Started(run_id=RUN, worker="w", token=1, attempt=1, start_step=0, at=11.0),
        Restored(run_id=RUN, worker="w", step=0, at=11.0),
        *progress("w", 0, 30, 11.0),
    ]
    g = goodput(events)
    assert g is not None and not g.finished
    assert g.wall_s == pytest.approx(4.0) and g.queued_s == pytest.approx(1.0)
    assert g.productive_s == pytest.approx(3.0)
