"""When the hub takes back a run granted to a linked site that nobody there trains
(`TakeBack._due`), on a real server's policy: at once when it was asked to cancel; after
two minutes of its pool's trainers there all idle beside it, counted afresh whenever one
is seen busy (a trainer between two runs is idle a moment)."""

from __future__ import annotations

from pathlib import Path

import msgspec
from nats.aio.client import Client

from services.reaper.grants import UNTAKEN_AFTER_S, TakeBack
from shared.checkpoint.store import open_store
from shared.contracts import RunState
from shared.contracts.pools import PoolTable
from shared.state.policy import Policy
from shared.state.runs import Runs
from tests.shared.state.test_transitions import record

LAB1 = {"lab1": 0.0}
"""The site greeted the hub just now: linked."""
POOL = {("lab1", "default")}


async def test_a_granted_run_idle_trainers_never_take_is_taken_back_after_two_idle_minutes(
    declared: Client, tmp_path: Path
) -> None:
    js = declared.jetstream()
    take = TakeBack(
        declared, js, await Runs.open(js), open_store(f"file://{tmp_path}"),
        Policy(js, PoolTable()),
    )  # fmt: skip
    queued = record(state=RunState.QUEUED, worker=None, site="lab1", epoch=5)
    assert take._due(queued, 0.0, LAB1, POOL, POOL) is None  # idle from now
    assert take._due(queued, 100.0, LAB1, POOL, set()) is None  # a trainer busy: afresh
    assert take._due(queued, 110.0, LAB1, POOL, POOL) is None  # idle again, from here
    assert take._due(queued, UNTAKEN_AFTER_S + 1, LAB1, POOL, POOL) is None  # not from 0
    assert take._due(queued, 110.0 + UNTAKEN_AFTER_S - 1, LAB1, POOL, POOL) is None
    why = take._due(queued, 110.0 + UNTAKEN_AFTER_S + 1, LAB1, POOL, POOL)
    assert why == "site lab1 with idle trainers that never take it for 121s (lost_after 600s)"
    # Asked to cancel before its site started it: at once, busy trainers or not.
    asked = msgspec.structs.replace(queued, run_id="r2", cancel_requested="no")
    assert take._due(asked, 0.0, LAB1, POOL, set()) == "asked to cancel before site lab1 started it"
    # Trained there (its worker known), it is the site's.
    assert take._due(msgspec.structs.replace(asked, worker="w"), 0.0, LAB1, POOL, POOL) is None
