"""Prepaid credits end to end: a short balance refused at submit; a run whose hold runs out
pauses at a checkpoint and, topped up and resumed, ends with the bits of an uninterrupted
run; the ledger balances to the unit — charged exactly the productive trainer-seconds at
the price, the rest refunded — also for a run whose trainer was SIGKILLed three times
(docs/scheduling.md, "Credits").

Real processes under `baton up`'s authorization; alice is a person (a submitter of her own),
the pool has a price. The runs are the character model (a shuffling data loader, AdamW, a
cosine schedule).
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client

from baton.client import calls as client
from shared.bus import names
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunRecord, RunState
from shared.contracts.control import Resume
from shared.contracts.events import Paused, Progress, Rejected, RunWarning, Started
from shared.contracts.pools import units
from shared.history.collect import collect
from shared.history.facts import Sighting, TopUpId
from shared.history.goodput import goodput
from shared.history.verify import check, describe
from shared.ledger import book
from shared.state.runs import Runs
from tests.e2e.jobs import finished, history, job, submit
from tests.support.cli import as_json, baton
from tests.support.ledger import balance, balanced, priced_stack, topup
from tests.support.stack import Stack, attempt_processes, eventually

pytestmark = [
    pytest.mark.sharing, pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")
]

PRICE = 0.01
"""Credits per trainer-second on the CPU."""
POOLS = f"""
[pools.default]
min_run_s = 0
price = {{ cpu = {PRICE} }}
estimate_margin = 2.0
"""


def charlm(key: str, total: int, pace: float, **over: Any) -> JobSpec:
    return job(
        name=over.pop("name", "charlm"), entry_point="examples.charlm:train", total_steps=total,
        seed=7, checkpoint={"every_steps": 40}, config={"pace": pace, "hidden": 32, "embed": 16},
        idempotency_key=key, **over,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """The hub's services, two trainers restarted when they die (as under `baton up`)."""
    async with priced_stack(tmp_path_factory.mktemp("credits"), POOLS, ("alice",)) as s:
        yield s


_reference: dict[int, str] = {}


async def reference(nc: Client, total: int) -> str:
    """An operator's uninterrupted run: no owner, so it costs no credits."""
    if total not in _reference:
        rec = await finished(nc, await submit(nc, charlm(f"ref-{total}", total, 0.0)), 180)
        assert rec.state is RunState.COMPLETED and rec.digest and not rec.price, rec
        _reference[total] = rec.digest
    return _reference[total]


async def record(nc: Client, run_id: str) -> RunRecord:
    found = await (await Runs.open(nc.jetstream())).get(run_id)
    assert found is not None, run_id
    return found[0]


async def test_a_short_balance_is_refused_at_submit_with_the_numbers(stack: Stack) -> None:
    alice = await stack.client_as("alice")
    spec = charlm("short", 100, 0.0, name="never-run", estimate_s=100)
    run_id, answer = await client.submit(alice, spec, 10)
    assert isinstance(answer, Rejected), answer
    assert "balance of 0 credits is short of the 2 " in answer.reason, answer.reason
    assert "estimate_s 100" in answer.reason, answer.reason
    assert await (await Runs.open(alice.jetstream())).get(run_id) is None, "nothing queued"


async def test_a_run_out_of_credits_pauses_and_resumes_bit_for_bit(stack: Stack) -> None:
    op, alice = await stack.client(), await stack.client_as("alice")
    total = 300
    want = await reference(op, total)
    before = await balance(op, "alice")
    await topup(op, "alice", 1.0)
    # A first estimate of 3 s for a run that trains for longer: its hold (3 s x 2 at the
    # price) runs out part-way, and it pauses at a checkpoint. Resumed, it holds what its
    # own steps so far say the rest takes, twice over: enough on a machine whose load
    # slows its steps down meanwhile.
    run_id = await submit(alice, charlm("paused", total, 0.02, name="first-of-its-name",
                                        estimate_s=3))  # fmt: skip
    hold = (await record(op, run_id)).holds
    assert hold == [units(3 * 2.0 * PRICE)], hold

    async def paused() -> Paused | None:
        found = [e for e in await history(op, run_id) if isinstance(e, Paused)]
        return found[0] if found else None

    pause = await eventually(paused, 120, "the run to pause on its credits")
    assert pause.reason.startswith("budget:"), pause
    rec = await record(op, run_id)
    assert rec.state is RunState.PAUSED and 0 < rec.step < total, rec
    warned = [e for e in await history(op, run_id) if isinstance(e, RunWarning)]
    assert any(w.kind == "credits_80" for w in warned), warned

    await topup(op, "alice", 1.0)
    await client.steer(alice, Resume(run_id=run_id, reason="topped up"))
    done = await finished(op, run_id, 180)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    assert len(done.holds) == 2, done.holds
    starts = [e.start_step for e in await history(op, run_id) if isinstance(e, Started)]
    assert starts == [0, pause.step], (starts, pause)
    settle = await balanced(op, "alice", run_id, before + units(2.0), PRICE)
    assert settle.failed_s == 0 and settle.charged <= settle.held, settle

    # The whole history keeps every invariant (docs/verify.md): every run with a price
    # settled exactly once, a top-up acknowledged by `baton credits` kept, and no training
    # process of the run left behind its end.
    code, out, err = await baton(stack, "credits", "topup", "alice", "0.5", "--id", "kept")
    assert code == 0 and "topped up alice" in out, (code, out, err)
    seen = [
        Sighting(run_id=run_id, pid=pid, alive_at=time.time())
        for name in ("t1", "t2") for pid in attempt_processes(stack.pid(name))
    ]  # fmt: skip
    async with open_store(stack.store_url) as store:
        found = await collect(op, store)
    found = msgspec.structs.replace(
        found, acknowledged_topups=[TopUpId(owner="alice", id="kept")], sightings=seen
    )
    assert run_id in found.checkpoints and len(found.ledger) >= 5, found.ledger
    assert check(found, settled_exactly=True) == [], [describe(v) for v in check(found)]
    verdict = await as_json(stack, "verify", "--settled")
    assert verdict["ok"] and verdict["entries"] == len(found.ledger), verdict


async def test_a_run_killed_three_times_is_charged_only_what_it_kept(stack: Stack) -> None:
    op, alice = await stack.client(), await stack.client_as("alice")
    total = 400
    want = await reference(op, total)
    before = await balance(op, "alice")
    await topup(op, "alice", 5.0)
    run_id = await submit(alice, charlm("killed", total, 0.03, name="killed", estimate_s=60))
    kills = 0
    step = 0
    while kills < 3:
        step = await eventually(lambda s=step: _past(op, run_id, s + 60), 120, "more steps")
        holder = (await record(op, run_id)).worker
        assert holder in ("t1", "t2"), holder
        stack.signal(holder, signal.SIGKILL)
        kills += 1
    done = await finished(op, run_id, 240)
    assert done.state is RunState.COMPLETED and done.digest == want, done
    spent = goodput(await history(op, run_id))
    assert spent is not None and spent.steps_redone > 0, spent  # the kills cost steps
    settle = await balanced(op, "alice", run_id, before + units(5.0), PRICE)
    # Redone steps were not charged: they are among the run's free seconds (so are its
    # restores and startups; the recovery between attempts is no attempt's at all).
    assert settle.free_s >= spent.wasted_s - 1e-6 and spent.wasted_s > 0, (settle, spent)
    assert settle.failed_s == 0, settle


async def _past(nc: Client, run_id: str, step: int) -> int | None:
    steps = [e.step for e in await history(nc, run_id) if isinstance(e, Progress)]
    return max(steps) if steps and max(steps) >= step else None


async def test_a_settlement_the_ledger_refuses_is_written_again_never_lost(stack: Stack) -> None:
    """The ledger's stream answers a refused write (a full disk, a limit) with the code it
    answers a repeat with (10077): the reaper reads the entry back before it takes that for
    "settled already", so the run stays unsettled — marked nothing, written again — until
    the ledger takes the entry, and is then settled once, to the unit. The full disk is the
    stream held at its size in bytes."""
    op, alice = await stack.client(), await stack.client_as("alice")
    before = await balance(op, "alice") + await topup(op, "alice", 2.0)
    run_id = await submit(alice, charlm("refused", 60, 0.05, name="refused", estimate_s=30))
    js = op.jetstream()

    async def held() -> bool:
        return await book.find(js, names.ledger_subject("alice", "hold", f"{run_id}.0")) is not None

    await eventually(held, 60, "the run's hold")
    config = (await js.stream_info(names.LEDGER_STREAM)).config
    full = (await js.stream_info(names.LEDGER_STREAM)).state.bytes
    await js.update_stream(dataclasses.replace(config, max_bytes=full))
    log = stack.root / "logs" / "reaper.log"
    try:
        done = await finished(op, run_id, 120)
        assert done.state is RunState.COMPLETED, done

        async def refused() -> bool:
            return f"{run_id}: its settlement was not stored" in log.read_text()

        await eventually(refused, 60, "the reaper's settlement to be refused")
        assert not (await record(op, run_id)).settled, "marked settled with no entry stored"
        assert await book.find(js, names.ledger_subject("alice", "settle", run_id)) is None
    finally:
        await js.update_stream(config)
    await balanced(op, "alice", run_id, before, PRICE)
    assert (await record(op, run_id)).settled
