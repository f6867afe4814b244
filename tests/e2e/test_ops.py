"""Operator commands against a real stack, run as a user runs them (subprocesses)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from shared.bus import names
from shared.contracts import RunState, run_id_for
from tests.e2e.jobs import finished, job, submit
from tests.support.cli import as_json, baton, run_baton
from tests.support.stack import REPO, Stack, eventually

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def ops(tmp_path: Path) -> AsyncIterator[Stack]:
    async with Stack(tmp_path / "stack", trainers=1, lease_ttl=3) as s:
        yield s


async def test_streams_runs_checkpoints_and_logs(ops: Stack, tmp_path: Path) -> None:
    nc = await ops.client()
    spec = job(entry_point="tests.support.workloads:chatty", total_steps=40)
    run_id = await submit(nc, spec)
    assert (await finished(nc, run_id)).state is RunState.COMPLETED

    reports = {r["name"]: r for r in await as_json(ops, "streams")}
    assert reports[names.EVENTS_STREAM]["messages"] > 0
    tasks = reports[names.TASKS_STREAM]
    assert [c["name"] for c in tasks["consumers"]] == [names.trainer_consumer("default")]
    assert tasks["consumers"][0]["ack_pending"] == 0 and tasks["messages"] == 0

    assert [r["run_id"] for r in await as_json(ops, "runs", "--state", "completed")] == [run_id]
    assert await as_json(ops, "runs", "--state", "failed") == []
    code, _, err = await baton(ops, "runs", "--state", "bogus")
    assert code == 2 and "bogus" in err.lower()

    rows = await as_json(ops, "checkpoints", run_id)
    assert rows[0]["step"] == 40 and rows[0]["final"]
    older = rows[1]["step"]
    rows = await as_json(ops, "checkpoints", run_id, "--pin", str(older))
    assert next(r for r in rows if r["step"] == older)["pinned"]
    code, _, err = await baton(ops, "checkpoints", run_id, "--pin", "7")
    assert code == 3 and "step 7" in err

    code, out, err = await baton(ops, "logs", run_id)
    assert code == 0, err
    assert "chatty: at step 0" in out and "chatty: at step 30" in out
    assert "completed" in err  # events go to stderr, the program's output to stdout
    # With only NATS_URL and credentials (no --store, no BATON_STORE, no ./.baton): the
    # store is where the hub's checkpointer says it is.
    bare = {
        **{k: v for k, v in os.environ.items() if k != "BATON_STORE"},
        "NATS_URL": ops.nats.url, "NATS_AUTH_FILE": str(ops.root / "auth" / "operator.env"),
    }  # fmt: skip
    code, out, err = await run_baton("checkpoints", run_id, "--json", env=bare, cwd=tmp_path)
    assert code == 0 and json.loads(out)[0]["step"] == 40, err
    code, out, err = await run_baton("pull", run_id, "got", "--json", env=bare, cwd=tmp_path)
    assert code == 0 and json.loads(out)["step"] == 40, err
    assert (tmp_path / "got").is_dir()
    code, out, err = await baton(ops, "logs", run_id, "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    said = "".join(x["text"] for x in lines if x["type"] == "output")
    assert "chatty: at step 0" in said and "chatty: at step 30" in said, said
    assert [x["step"] for x in lines if x["type"] == "completed"] == [40], lines


async def test_logs_follow_prints_output_as_it_comes(ops: Stack) -> None:
    nc = await ops.client()
    spec = job(entry_point="tests.support.workloads:chatty", total_steps=400, config={"pace": 0.02})
    run_id = await submit(nc, spec)
    env = {
        **os.environ, "NATS_URL": ops.nats.url,
        "NATS_AUTH_FILE": str(ops.root / "auth" / "operator.env"),
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", "logs", run_id, "--follow", cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        seen = b""
        while b"chatty: at step 100" not in seen:
            seen += await asyncio.wait_for(proc.stdout.readline(), 30)
        record = await nc.jetstream().key_value(names.RUNS_BUCKET)
        entry = await record.get(run_id)
        assert entry.value is not None and b"COMPLETED" not in entry.value  # it is live
    finally:
        proc.kill()
        await proc.wait()


async def test_dead_letters_list_show_and_replay(ops: Stack) -> None:
    nc = await ops.client()
    js = nc.jetstream()
    bad = b'{"name": "x", "entry_point": "m:f", "total_steps": "many"}'
    await js.publish(names.submit_subject("default"), bad, headers={"Nats-Msg-Id": "bad-1"})

    async def listed() -> list[Any]:
        return list(await as_json(ops, "dlq", "list"))

    (letter,) = await eventually(listed, 15, "the dead letter")
    assert "total_steps" in letter["letter"]["reason"]
    seq = str(letter["seq"])
    shown = await as_json(ops, "dlq", "show", seq)
    assert shown["letter"]["subject"] == names.submit_subject("default")
    code, out, _ = await baton(ops, "dlq", "show", seq)
    assert code == 0 and '"total_steps": "many"' in out
    replay = await as_json(ops, "dlq", "replay", seq)
    assert replay == {"replayed": int(seq), "subject": names.submit_subject("default")}, replay

    async def replayed() -> list[Any] | None:
        letters = await listed()
        return letters if letters and all(str(x["seq"]) != seq for x in letters) else None

    (again,) = await eventually(replayed, 15, "the replayed message to be handled again")
    assert again["letter"]["reason"] == letter["letter"]["reason"]
    code, _, _ = await baton(ops, "dlq", "show", seq)
    assert code == 3
    assert run_id_for("bad-1")
