"""Operators' rollbacks as the dispatcher takes them, against a real nats-server and a real
store (the dispatcher in-process): an order written into a live run's record, a FAILED run
reopened with its task queued again, and what cannot apply dead-lettered with its reason and
nothing changed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from shared.bus import names
from shared.checkpoint.store import open_store
from shared.contracts import RunRecord, RunState, decode, encode, run_id_for
from shared.contracts.control import Rollback
from shared.contracts.letters import DeadLetter
from shared.state.runs import Runs
from tests.services.dispatcher.test_service import GOOD, submit, tasks_for
from tests.services.dispatcher.test_steering import serving
from tests.shared.checkpoint.test_rebase import commit_step
from tests.support.stack import eventually
from tests.support.trainers import heartbeats


async def rollback(nc: Client, run_id: str, step: int) -> None:
    req = Rollback(run_id=run_id, step=step, reason="bad data")
    await nc.jetstream().publish(names.steer_subject(run_id), encode(req))


async def test_rollbacks_are_ordered_reopen_failed_runs_and_refuse_what_cannot_apply(
    nc: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path / 'store'}"
    monkeypatch.setenv("BATON_STORE", url)  # the dispatcher's store, as `baton up` sets it
    async with heartbeats(nc, 1):  # a trainer, idle: the scheduler admits the run at once
        await _rollbacks(nc, url)


async def _rollbacks(nc: Client, url: str) -> None:
    stop, task = await serving(nc, {})
    runs = await Runs.open(nc.jetstream())
    await submit(nc, json.dumps({**GOOD, "idempotency_key": "k"}).encode(), "k")
    run_id = run_id_for("k")
    await eventually(lambda: runs.get(run_id), 10, "the run")
    async with open_store(url) as store:
        for step in (10, 20, 30):
            await commit_step(store, 1, step, run=run_id)

    async def record_where(check: Callable[[RunRecord], bool]) -> RunRecord | None:
        found = await runs.get(run_id)
        return found[0] if found and check(found[0]) else None

    # A queued (or running, or paused) run: the order, in its record.
    await rollback(nc, run_id, 20)
    ordered = await eventually(lambda: record_where(lambda r: r.rollback_to == 20), 10, "the order")
    assert ordered.state is RunState.QUEUED and ordered.rollback_reason == "bad data", ordered

    # A failed run: reopened, its task queued again at the next dispatch.
    def failed(r: RunRecord) -> RunRecord:
        return msgspec.structs.replace(
            r, state=RunState.FAILED, reason="boom", retries=4, rollback_to=None
        )

    await eventually(lambda: _count(nc, run_id, 1), 10, "its task")
    await runs.update(run_id, failed)
    assert await tasks_for(nc, run_id) == 1
    await rollback(nc, run_id, 10)
    reopened = await eventually(
        lambda: record_where(lambda r: r.state is RunState.QUEUED and r.rollback_to == 10),
        10,
        "the failed run reopened",
    )
    assert (reopened.dispatch, reopened.retries, reopened.reason) == (2, 0, None), reopened
    await eventually(lambda: _count(nc, run_id, 2), 10, "its task queued again")

    # What cannot apply: a step with no committed checkpoint, a finished run.
    await rollback(nc, run_id, 15)
    letter = await eventually(lambda: _letter(nc, "step 15"), 10, "the refusal")
    assert "steps available: 10, 20, 30" in letter.reason, letter

    def completed(r: RunRecord) -> RunRecord:
        return msgspec.structs.replace(r, state=RunState.COMPLETED, rollback_to=None)

    done = await runs.update(run_id, completed)
    assert done is not None
    await rollback(nc, run_id, 20)
    letter = await eventually(lambda: _letter(nc, "fork it"), 10, "the refusal")
    assert "COMPLETED" in letter.reason, letter
    after = await runs.get(run_id)
    assert after is not None and after[0] == done, "nothing changed"
    stop.set()
    await task


async def _count(nc: Client, run_id: str, wanted: int) -> bool:
    return await tasks_for(nc, run_id) == wanted


async def _letter(nc: Client, needle: str) -> DeadLetter | None:
    js = nc.jetstream()
    try:
        info = await js.stream_info(names.DLQ_STREAM)
    except Exception:
        return None
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(names.DLQ_STREAM, seq)
        except Exception:
            continue  # not stored (yet): the stream's sequence may skip
        letter = decode(msg.data, DeadLetter) if msg.data else None
        if letter is not None and needle in letter.reason:
            return letter
    return None
