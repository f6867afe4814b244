"""Submit -> dispatch -> train -> commit -> complete, with every service a real process."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from safetensors.torch import load_file

from baton.client import calls as client
from shared.bus import names
from shared.checkpoint import commit
from shared.checkpoint.digest import weights_digest
from shared.checkpoint.store import open_store
from shared.contracts import RunState, job_schema, run_id_for
from shared.contracts.events import CheckpointCommitted, Completed, Progress, Rejected
from tests.e2e.jobs import finished, history, job, submit
from tests.support.stack import Stack, eventually


async def test_example_job_completes_commits_and_pulls(stack: Stack, tmp_path: Path) -> None:
    nc = await stack.client()
    run_id = await submit(nc, job(total_steps=150))
    record = await finished(nc, run_id)
    assert record.state is RunState.COMPLETED, record
    assert record.step == 150 and record.digest

    events = await history(nc, run_id)
    losses = [e.metrics["loss"] for e in events if isinstance(e, Progress) and "loss" in e.metrics]
    assert losses[-1] < 0.5 * losses[0], losses  # it really learned
    final = [e for e in events if isinstance(e, CheckpointCommitted) and e.final]
    assert len(final) == 1 and final[0].step == 150
    assert isinstance(events[-1], Completed)

    async with open_store(stack.store_url) as store:
        latest = await commit.read_latest(store, run_id)
        assert latest is not None and latest[0].final and latest[0].step == 150

    info = await client.pull(stack.store_url, run_id, tmp_path / "pulled")
    assert info["step"] == 150 and info["digest"] == record.digest
    weights = load_file(str(tmp_path / "pulled" / "model.safetensors"))
    assert weights_digest(weights) == record.digest
    meta = json.loads((tmp_path / "pulled" / "meta.json").read_text())
    assert meta["step"] == 150 and "rng" in meta


async def test_bad_submissions_do_not_stop_the_next_job(stack: Stack) -> None:
    nc = await stack.client()
    js = nc.jetstream()
    for key, payload in [
        ("junk", b"\x00\xffnot json"),
        ("neg", json.dumps({"name": "x", "entry_point": "m:f", "total_steps": -1}).encode()),
    ]:
        await js.publish(names.submit_subject("default"), payload, headers={"Nats-Msg-Id": key})

    async def rejected(key: str) -> bool:
        return any(isinstance(e, Rejected) for e in await history(nc, run_id_for(key)))

    for key in ("junk", "neg"):
        await eventually(lambda k=key: rejected(k), 10, f"rejection of {key}")  # type: ignore[misc]
    run_id = await submit(nc, job(total_steps=40))
    assert (await finished(nc, run_id)).state is RunState.COMPLETED


async def test_schema_is_json_schema_and_a_hand_built_job_is_accepted(stack: Stack) -> None:
    schema = job_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    by_hand = {
        "name": "by-hand",
        "entry_point": "examples.regression:train",
        "total_steps": 30,
        "idempotency_key": "by-hand-1",
        "checkpoint": {"every_steps": 10},
    }
    jsonschema.validate(by_hand, schema)
    with_unknown = {**by_hand, "bogus": 1}
    try:
        jsonschema.validate(with_unknown, schema)
        raise AssertionError("the schema accepted an unknown field")
    except jsonschema.ValidationError:
        pass
    nc = await stack.client()
    await nc.jetstream().publish(names.submit_subject("default"), json.dumps(by_hand).encode())
    assert (await finished(nc, run_id_for("by-hand-1"))).state is RunState.COMPLETED
