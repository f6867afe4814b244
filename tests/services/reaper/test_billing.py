"""Settling a run its owner held nothing for (submitted at a cut-off site, charged at heal):
the settlement charges its events, gives back nothing, and — its owner's balance now below
zero — says so in a `credits_overdrawn` warning, once. Its code runs as the `reaper` user of
a server with `baton up`'s authorization: what it reads and writes, its role must allow."""

from __future__ import annotations

import time

import msgspec

from services.reaper.billing import Billing
from services.reaper.sites import SiteWatch
from shared.bus.emit import emit
from shared.bus.history import run_events
from shared.contracts import JobSpec, RunRecord, RunState, convert, spec_hash
from shared.contracts.events import Accepted, Completed, Progress, Restored, RunWarning, Started
from shared.contracts.ledger import Settle, TopUp
from shared.ledger import book
from shared.state.runs import Runs
from tests.support.roles import AuthorizedHub

SPEC = convert({"name": "t", "entry_point": "m:f", "total_steps": 20}, JobSpec)
RUN = "lab1-ann.r0123456789abcdef0123"


async def test_a_run_held_for_nothing_is_charged_and_its_overdraft_said_once(
    authorized: AuthorizedHub,
) -> None:
    op = await authorized.connect("operator")
    js = op.jetstream()
    reaper = await authorized.connect("reaper")
    runs = await Runs.open(reaper.jetstream())
    billing = Billing(reaper, runs, SiteWatch(reaper, reaper.jetstream()))
    await book.write(js, TopUp(owner="lab1-ann", id="t1", amount=10))
    now = time.time()
    await emit(js, Accepted(run_id=RUN, name="t", pool="default", total_steps=20, at=now))
    started = Started(run_id=RUN, worker="w", token=1, attempt=1, start_step=0, device="cpu")
    await emit(js, msgspec.structs.replace(started, at=now))
    await emit(js, Restored(run_id=RUN, worker="w", step=0, at=now))
    await emit(js, Progress(run_id=RUN, step=20, total_steps=20, worker="w", at=now + 2.0))
    await emit(js, Completed(run_id=RUN, step=20, digest="d", at=now + 2.0))
    record = RunRecord(
        run_id=RUN, spec=SPEC, spec_hash=spec_hash(SPEC), created_at=now, updated_at=now,
        state=RunState.COMPLETED, price={"cpu": 0.01},
    )  # fmt: skip
    assert await runs.create(record)

    assert await billing.settle(record)
    settle = await book.find(js, book.settle_subject("lab1-ann", RUN, 0))
    assert isinstance(settle, Settle) and settle.held == 0 and settle.charged > 10, settle
    assert settle.through > 0, "charged from its events, which it names"
    balance = (await book.read(op, "lab1-ann"))["lab1-ann"].balance
    assert balance == 10 - settle.charged < 0
    assert await billing.settle(msgspec.structs.replace(record, settled=False))  # again
    warned = [e for e in await run_events(js, RUN) if isinstance(e, RunWarning)]
    assert [w.kind for w in warned] == ["credits_overdrawn"], warned
    assert "balance is -" in warned[0].detail, warned[0].detail
