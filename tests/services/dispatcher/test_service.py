"""The dispatcher against a real nats-server, in-process: validation, idempotency, DLQ."""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client

from baton.client import calls as client
from services.dispatcher.service import Dispatcher
from shared import config
from shared.bus import names
from shared.bus.streams import ensure
from shared.contracts import decode, run_id_for
from shared.contracts.events import Accepted, Event, Rejected
from shared.contracts.letters import DeadLetter
from shared.contracts.records import replica_run_id
from shared.state.runs import Runs
from tests.support.stack import eventually
from tests.support.trainers import heartbeats

GOOD = {"name": "t", "entry_point": "examples.regression:train", "total_steps": 10}


async def start_dispatchers(
    nc: Client, count: int = 1
) -> tuple[asyncio.Event, list[asyncio.Task[None]]]:
    stop = asyncio.Event()
    tasks = []
    for _ in range(count):
        d = Dispatcher(nc, config.load({"NATS_URL": "unused"}))
        await d.start()
        tasks.append(asyncio.create_task(d.serve(stop)))
    return stop, tasks


async def events_of(nc: Client, run_id: str) -> list[Event]:
    return await client.history(nc, run_id)


async def tasks_for(nc: Client, run_id: str) -> int:
    info = await nc.jetstream().stream_info(
        names.TASKS_STREAM, subjects_filter=names.task_subject("default", run_id)
    )
    return sum((info.state.subjects or {}).values())


async def submit(nc: Client, payload: bytes, key: str, pool: str = "default") -> None:
    await nc.jetstream().publish(names.submit_subject(pool), payload, headers={"Nats-Msg-Id": key})


BAD = [
    ("malformed", b'{"name": "t", "entry_', "malformed JSON", "$"),
    (
        "unknown-field",
        json.dumps({**GOOD, "gpu_count": 8}).encode(),
        "unknown field `gpu_count`",
        "$",
    ),
    (
        "wrong-type",
        json.dumps({**GOOD, "total_steps": "ten"}).encode(),
        "Expected `int`, got `str`",
        "$.total_steps",
    ),
    (
        "no-entry-point",
        json.dumps({"name": "t", "total_steps": 10}).encode(),
        "missing required field `entry_point`",
        "$",
    ),
    (
        "negative-steps",
        json.dumps({**GOOD, "total_steps": -5}).encode(),
        "Expected `int` >= 1",
        "$.total_steps",
    ),
    (
        "oversized",
        json.dumps({**GOOD, "config": {"blob": "x" * 200_000}}).encode(),
        "over the limit",
        "$",
    ),
    (
        "bad-entry-point",
        json.dumps({**GOOD, "entry_point": "os.system"}).encode(),
        "Expected `str` matching",
        "$.entry_point",
    ),
    (
        "replica-set-by-submitter",
        json.dumps({**GOOD, "replicas": 2, "replica": 0}).encode(),
        "set by the dispatcher",
        "$.replica",
    ),
    (
        "elastic-replicas",
        json.dumps({**GOOD, "replicas": 2, "ranks": {"min": 1, "max": 2}}).encode(),
        "ranks must be a number",
        "$",
    ),
    (
        "pool-mismatch",
        json.dumps({**GOOD, "pool": "gpu"}).encode(),
        "differs from the subject's pool",
        "$.pool",
    ),
]


async def test_bad_input_is_rejected_named_and_dead_lettered(nc: Client) -> None:
    async with heartbeats(nc, 1):
        await _bad_input_is_rejected(nc)


async def _bad_input_is_rejected(nc: Client) -> None:
    stop, tasks = await start_dispatchers(nc)
    runs = await Runs.open(nc.jetstream())
    for key, payload, _reason, _path in BAD:
        await submit(nc, payload, key)
    for key, _payload, reason, path in BAD:
        run_id = run_id_for(key)
        evs = await eventually(
            lambda run_id=run_id: events_of(nc, run_id), 10, f"rejection of {key}"
        )
        assert len(evs) == 1 and isinstance(evs[0], Rejected), (key, evs)
        assert reason in evs[0].reason, (key, evs[0].reason)
        assert evs[0].path == path, (key, evs[0].path)
        assert await runs.get(run_id) is None, f"{key} created a run record"
        assert await tasks_for(nc, run_id) == 0
    info = await nc.jetstream().stream_info(names.DLQ_STREAM)
    assert info.state.messages == len(BAD)
    letter = decode(
        (await nc.jetstream().get_last_msg(names.DLQ_STREAM, names.dlq_subject("dispatcher"))).data,
        DeadLetter,
    )
    assert letter.reason and letter.source == "dispatcher"
    # It survived all of that and still serves.
    await submit(nc, json.dumps(GOOD).encode(), "good-after-bad")
    await eventually(lambda: runs.get(run_id_for("good-after-bad")), 10, "the next valid job")

    async def one_task() -> bool:
        return await tasks_for(nc, run_id_for("good-after-bad")) == 1

    await eventually(one_task, 10, "the next valid job's task")
    stop.set()
    await asyncio.gather(*tasks)


async def test_same_key_twice_and_concurrently_gives_one_run_one_task(nc: Client) -> None:
    async with heartbeats(nc, 2):
        await _same_key_twice(nc)


async def _same_key_twice(nc: Client) -> None:
    stop, tasks = await start_dispatchers(nc, count=2)
    runs = await Runs.open(nc.jetstream())
    spec = json.dumps({**GOOD, "idempotency_key": "once"}).encode()
    # Twice in sequence, as different messages (distinct Nats-Msg-Ids so JetStream's own
    # de-duplication does not hide the dispatcher's).
    await submit(nc, spec, "a")
    await eventually(lambda: runs.get(run_id_for("once")), 10, "the first run record")
    await submit(nc, spec, "b")
    # And concurrently, racing two dispatchers.
    await asyncio.gather(*(submit(nc, spec, f"c{i}") for i in range(6)))
    run_id = run_id_for("once")

    async def all_answered() -> list[Event] | None:
        evs = [e for e in await events_of(nc, run_id) if isinstance(e, Accepted)]
        return (
            evs if len(evs) >= 1 + 1 + 6 - 1 else None
        )  # the first accepted is de-duplicated by id

    accepted = await eventually(all_answered, 15, "every submission answered")
    assert sum(not e.duplicate for e in accepted) == 1

    async def admitted() -> bool:
        return await tasks_for(nc, run_id) == 1

    await eventually(admitted, 10, "the run's task")
    assert await tasks_for(nc, run_id) == 1
    assert len(await runs.all()) == 1
    # Every submission was acked, so the work queue is empty.
    assert (await nc.jetstream().stream_info(names.SUBMIT_STREAM)).state.messages == 0
    stop.set()
    await asyncio.gather(*tasks)


async def test_same_key_with_a_different_spec_is_rejected(nc: Client) -> None:
    stop, tasks = await start_dispatchers(nc)
    runs = await Runs.open(nc.jetstream())
    await submit(nc, json.dumps({**GOOD, "idempotency_key": "k"}).encode(), "1")
    await eventually(lambda: runs.get(run_id_for("k")), 10, "the run record")
    await submit(nc, json.dumps({**GOOD, "total_steps": 99, "idempotency_key": "k"}).encode(), "2")

    async def rejected() -> list[Event]:
        return [e for e in await events_of(nc, run_id_for("k")) if isinstance(e, Rejected)]

    (event,) = await eventually(rejected, 10, "the rejection")
    assert isinstance(event, Rejected) and "different job spec" in event.reason
    found = await runs.get(run_id_for("k"))
    assert found is not None and found[0].spec.total_steps == 10
    stop.set()
    await asyncio.gather(*tasks)


async def test_one_batch_handled_at_once_keeps_every_guarantee(nc: Client) -> None:
    """Copies of one submission, a poison message, a conflicting spec and other jobs, all
    waiting before the dispatcher starts, so that its first fetch takes them as one batch
    and handles them at once."""
    await ensure(nc.jetstream())  # the streams, before any dispatcher serves
    runs = await Runs.open(nc.jetstream())
    same = json.dumps({**GOOD, "idempotency_key": "same"}).encode()
    for i in range(20):
        await submit(nc, same, f"same-{i}")
    await submit(nc, b'{"name": "t", "entry_', "poison")
    other_spec = json.dumps({**GOOD, "total_steps": 99, "idempotency_key": "same"}).encode()
    await submit(nc, other_spec, "x")
    others = [f"other-{i}" for i in range(20)]
    for key in others:
        await submit(nc, json.dumps({**GOOD, "idempotency_key": key}).encode(), key)
    async with heartbeats(nc, 25):
        await _one_batch(nc, runs, others)


async def _one_batch(nc: Client, runs: Runs, others: list[str]) -> None:
    stop, tasks = await start_dispatchers(nc)

    async def drained() -> bool:
        return (await nc.jetstream().stream_info(names.SUBMIT_STREAM)).state.messages == 0

    await eventually(drained, 20, "every submission answered")
    run_id = run_id_for("same")
    answers = await eventually(
        lambda: _answers(nc, run_id, 21), 10, "an answer to each copy of the same job"
    )
    accepted = [e for e in answers if isinstance(e, Accepted)]
    rejected = [e for e in answers if isinstance(e, Rejected)]
    assert sum(not e.duplicate for e in accepted) == 1 and len(accepted) == 20
    assert len(rejected) == 1 and "different job spec" in rejected[0].reason

    async def admitted() -> bool:  # the scheduler admits each, once, a trainer being free
        counts = [await tasks_for(nc, r) for r in (run_id, *map(run_id_for, others))]
        assert max(counts) <= 1, counts
        return min(counts) == 1

    await eventually(admitted, 10, "every run's task")
    found = await runs.get(run_id)
    assert found is not None and found[0].spec.total_steps == 10
    letters = await nc.jetstream().stream_info(names.DLQ_STREAM)
    assert letters.state.messages == 2  # the poison and the conflicting spec, each once
    poison = await eventually(
        lambda: events_of(nc, run_id_for("poison")), 10, "the poison's rejection"
    )
    assert isinstance(poison[0], Rejected) and "malformed JSON" in poison[0].reason
    stop.set()
    await asyncio.gather(*tasks)


async def _answers(nc: Client, run_id: str, count: int) -> list[Event] | None:
    evs = [e for e in await events_of(nc, run_id) if isinstance(e, Accepted | Rejected)]
    return evs if len(evs) >= count else None


async def test_a_replicated_job_is_one_run_per_replica_each_queued_once(nc: Client) -> None:
    """`replicas = 3`: runs `<run>-replica-0..2`, each its spec with `replica` set and one
    task; accepted under the replicated run's own id too; a resubmission adds nothing."""
    async with heartbeats(nc, 3):
        await _replicated(nc)


async def _replicated(nc: Client) -> None:
    stop, tasks = await start_dispatchers(nc)
    runs = await Runs.open(nc.jetstream())
    spec = json.dumps({**GOOD, "replicas": 3, "idempotency_key": "rep"}).encode()
    await submit(nc, spec, "r1")
    run_id = run_id_for("rep")
    ids = [replica_run_id(run_id, i) for i in range(3)]

    async def accepted() -> bool:
        return any(isinstance(e, Accepted) for e in await events_of(nc, run_id))

    await eventually(accepted, 10, "the replicated run accepted")

    async def admitted() -> bool:
        return all([await tasks_for(nc, rid) == 1 for rid in ids])

    await eventually(admitted, 10, "each replica's task")
    for i, rid in enumerate(ids):
        found = await runs.get(rid)
        assert found is not None and found[0].spec.replica == i, (rid, found)
        assert found[0].spec.replicated
    assert await runs.get(run_id) is None  # no record stands for the replicated run
    await submit(nc, spec, "r2")

    async def twice() -> bool:
        return sum(isinstance(e, Accepted) for e in await events_of(nc, run_id)) == 2

    await eventually(twice, 10, "the resubmission answered")
    assert all([await tasks_for(nc, rid) == 1 for rid in ids]) and len(await runs.all()) == 3
    stop.set()
    await asyncio.gather(*tasks)
