"""When the hub takes back a run granted to a linked site that nobody there trains
(`TakeBack._due`), on a real server's policy: at once when it was asked to cancel; after
two minutes of its pool's trainers there all idle beside it, counted afresh whenever one
is seen busy (a trainer between two runs is idle a moment); after two minutes of the
trainer its site's record names not training it, counted afresh whenever it does."""

from __future__ import annotations

from pathlib import Path

import msgspec
from nats.aio.client import Client

from services.reaper.grants import UNTAKEN_AFTER_S, SiteTrainers, TakeBack
from shared.checkpoint.store import open_store
from shared.contracts import RunState
from shared.contracts.pools import PoolTable
from shared.state.policy import Policy
from shared.state.runs import Runs
from tests.shared.state.test_transitions import record

LAB1 = {"lab1": 0.0}
"""The site greeted the hub just now: linked."""
POOL = {("lab1", "default")}
IDLE = SiteTrainers(serving=POOL, idle=POOL, training={"lab1-t": None})
"""The site's one trainer of the pool, training nothing."""
BUSY = SiteTrainers(serving=POOL, idle=set(), training={"lab1-t": "other"})
"""It trains another run."""


async def take_back(declared: Client, tmp_path: Path) -> TakeBack:
    js = declared.jetstream()
    return TakeBack(
        declared, js, await Runs.open(js), open_store(f"file://{tmp_path}"),
        Policy(js, PoolTable()),
    )  # fmt: skip


async def test_a_granted_run_idle_trainers_never_take_is_taken_back_after_two_idle_minutes(
    declared: Client, tmp_path: Path
) -> None:
    take = await take_back(declared, tmp_path)
    queued = record(state=RunState.QUEUED, worker=None, site="lab1", epoch=5)
    assert take._due(queued, 0.0, LAB1, IDLE) is None  # idle from now
    assert take._due(queued, 100.0, LAB1, BUSY) is None  # a trainer busy: afresh
    assert take._due(queued, 110.0, LAB1, IDLE) is None  # idle again, from here
    assert take._due(queued, UNTAKEN_AFTER_S + 1, LAB1, IDLE) is None  # not from 0
    assert take._due(queued, 110.0 + UNTAKEN_AFTER_S - 1, LAB1, IDLE) is None
    why = take._due(queued, 110.0 + UNTAKEN_AFTER_S + 1, LAB1, IDLE)
    assert why == "site lab1 with idle trainers that never take it for 121s (lost_after 600s)"
    # Asked to cancel before its site started it: at once, busy trainers or not.
    asked = msgspec.structs.replace(queued, run_id="r2", cancel_requested="no")
    assert take._due(asked, 0.0, LAB1, BUSY) == "asked to cancel before site lab1 started it"
    # Trained there (its worker known, and training it), it is the site's.
    trains = SiteTrainers(serving=POOL, idle=set(), training={"lab1-t": "r2"})
    held = msgspec.structs.replace(asked, worker="lab1-t", state=RunState.RUNNING)
    assert take._due(held, 0.0, LAB1, trains) is None


async def test_a_granted_run_whose_record_names_a_trainer_that_does_not_train_it_is_taken_back(
    declared: Client, tmp_path: Path
) -> None:
    """The site's record says RUNNING on a trainer whose heartbeats name another run, or
    none, or which is gone: a record nobody there acts on (its task ended or spent its
    deliveries) is taken back after two minutes, counted afresh while the trainer trains
    it."""
    take = await take_back(declared, tmp_path)
    held = record(state=RunState.RUNNING, worker="lab1-t", site="lab1", epoch=5)
    trains = SiteTrainers(serving=POOL, idle=set(), training={"lab1-t": held.run_id})
    assert take._due(held, 0.0, LAB1, trains) is None
    assert take._due(held, 10.0, LAB1, BUSY) is None  # from now
    assert take._due(held, 20.0, LAB1, trains) is None  # it trains it again: afresh
    assert take._due(held, 30.0, LAB1, IDLE) is None  # from here
    assert take._due(held, 30.0 + UNTAKEN_AFTER_S - 1, LAB1, IDLE) is None
    why = take._due(held, 30.0 + UNTAKEN_AFTER_S + 1, LAB1, IDLE)
    assert why == (
        "site lab1 with its record held by lab1-t, which trains nothing, for 121s (lost_after 600s)"
    ), why
    gone = SiteTrainers(serving=POOL, idle=POOL, training={"lab1-u": None})
    why = take._due(held, 30.0 + UNTAKEN_AFTER_S + 2, LAB1, gone)
    assert why is not None and "lab1-t, which is gone," in why, why
    # A cut: its trainers' heartbeats come back after the link does; counted from the heal.
    cut = {"lab1": 30.0}
    assert take._due(held, 200.0, cut, gone) is None
    assert take._due(held, 300.0, LAB1, gone) is None  # healed: from here
    assert take._due(held, 300.0 + UNTAKEN_AFTER_S - 1, LAB1, gone) is None
    assert take._due(held, 300.0 + UNTAKEN_AFTER_S + 1, LAB1, gone) is not None
