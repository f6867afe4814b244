"""Operators' steering requests against a real nats-server, with the dispatcher in-process:
pausing a queued run takes its task out of the queue, resuming queues a new one, a request
that does not apply is dead-lettered with its reason and changes nothing; and the failure
policy in force is the job's, else its pool's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from nats.aio.client import Client

from services.dispatcher.service import Dispatcher
from shared import config
from shared.bus import names
from shared.contracts import RunState, decode, encode, run_id_for
from shared.contracts.control import Pause, Resume
from shared.contracts.events import Paused, Resumed
from shared.contracts.letters import DeadLetter
from shared.state.runs import Runs
from tests.services.dispatcher.test_service import GOOD, events_of, submit, tasks_for
from tests.support.stack import eventually
from tests.support.trainers import heartbeats


async def serving(nc: Client, env: dict[str, str]) -> tuple[asyncio.Event, asyncio.Task[None]]:
    d = Dispatcher(nc, config.load({"NATS_URL": "unused", **env}))
    await d.start()
    stop = asyncio.Event()
    return stop, asyncio.create_task(d.serve(stop))


async def steer(nc: Client, req: Pause | Resume) -> None:
    await nc.jetstream().publish(names.steer_subject(req.run_id), encode(req))


async def test_pause_and_resume_a_queued_run(nc: Client) -> None:
    async with heartbeats(nc, 1):  # a trainer, idle: the scheduler admits the run at once
        await _pause_and_resume(nc)


async def _pause_and_resume(nc: Client) -> None:
    stop, task = await serving(nc, {})
    runs = await Runs.open(nc.jetstream())
    await submit(nc, json.dumps({**GOOD, "idempotency_key": "p"}).encode(), "p")
    run_id = run_id_for("p")

    async def queued() -> bool:
        return await tasks_for(nc, run_id) == 1

    await eventually(queued, 10, "its task")
    await steer(nc, Pause(run_id=run_id, reason="not now"))

    async def paused() -> bool:
        found = await runs.get(run_id)
        return found is not None and found[0].state is RunState.PAUSED

    await eventually(paused, 10, "PAUSED")
    assert await tasks_for(nc, run_id) == 0  # nothing left for a trainer to take
    record = (await runs.get(run_id) or (None,))[0]
    assert record is not None and record.pause_requested == "not now"

    await steer(nc, Resume(run_id=run_id))

    async def requeued() -> bool:
        found = await runs.get(run_id)
        return found is not None and found[0].state is RunState.QUEUED

    await eventually(requeued, 10, "QUEUED again")
    await eventually(queued, 10, "a task again")
    record = (await runs.get(run_id) or (None,))[0]
    assert record is not None and record.dispatch == 2 and record.pause_requested is None

    async def told() -> list[type] | None:
        kinds = [type(e) for e in await events_of(nc, run_id) if isinstance(e, Paused | Resumed)]
        return kinds if len(kinds) == 2 else None

    assert await eventually(told, 10, "paused and resumed events") == [Paused, Resumed]
    stop.set()
    await task


async def test_a_request_that_does_not_apply_is_dead_lettered_and_changes_nothing(
    nc: Client,
) -> None:
    stop, task = await serving(nc, {})
    runs = await Runs.open(nc.jetstream())
    await submit(nc, json.dumps({**GOOD, "idempotency_key": "q"}).encode(), "q")
    run_id = run_id_for("q")
    await eventually(lambda: runs.get(run_id), 10, "the run")
    before = await runs.get(run_id)
    await steer(nc, Resume(run_id=run_id))  # it is not paused
    # A body naming another run than its subject does is refused too.
    other = Pause(run_id=run_id_for("elsewhere"))
    await nc.jetstream().publish(names.steer_subject(run_id), encode(other))

    async def letters() -> list[DeadLetter] | None:
        info = await nc.jetstream().stream_info(names.DLQ_STREAM)
        if info.state.messages < 2:
            return None
        got = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            got.append(
                decode((await nc.jetstream().get_msg(names.DLQ_STREAM, seq)).data, DeadLetter)
            )
        return got

    found = await eventually(letters, 10, "two dead letters")
    reasons = [letter.reason for letter in found]
    assert any("resume does not apply" in r and "QUEUED" in r for r in reasons), reasons
    assert any("differs from the subject's" in r for r in reasons), reasons
    after = await runs.get(run_id)
    assert before is not None and after is not None and after[1] == before[1]  # unchanged
    stop.set()
    await task


async def test_the_failure_policy_is_the_jobs_else_the_pools(nc: Client, tmp_path: Path) -> None:
    pools = tmp_path / "pools.toml"
    pools.write_text('[pools.default]\non_failure = "pause"\n')
    stop, task = await serving(nc, {"BATON_POOLS_FILE": str(pools)})
    runs = await Runs.open(nc.jetstream())
    await submit(nc, json.dumps({**GOOD, "idempotency_key": "a"}).encode(), "a")
    own = {**GOOD, "idempotency_key": "b", "on_failure": "fail_fast"}
    await submit(nc, json.dumps(own).encode(), "b")
    a = await eventually(lambda: runs.get(run_id_for("a")), 10, "run a")
    b = await eventually(lambda: runs.get(run_id_for("b")), 10, "run b")
    assert (a[0].on_failure, b[0].on_failure) == ("pause", "fail_fast")
    stop.set()
    await task
