"""Rolling a run back, forking one, pulling any committed checkpoint — on a real stack with
`baton up`'s authorization, driven through the `baton` command as an operator runs it.

The run is held at a known step by a gate file (`tests.support.tunable:gated`), never by
timing: it trains to step 65 (a checkpoint due every 10 steps) and waits there until the
test opens the gate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from shared.bus import names
from shared.checkpoint import commit, retention
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunState, decode, encode
from shared.contracts.control import Rollback
from shared.contracts.events import (
    CheckpointCommitted,
    Forked,
    Preempted,
    RolledBack,
    Started,
)
from shared.contracts.letters import DeadLetter
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.cli import as_json, baton
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.operations]

GATE_AT = 65


def gated(gate: Path, **config: Any) -> JobSpec:
    return job(
        entry_point="tests.support.tunable:gated",
        total_steps=100,
        checkpoint={"every_steps": 10, "keep_last": 20},
        config={"gate": str(gate), "gate_at": GATE_AT, "pace": 0.05, **config},
    )


async def test_rollback_fork_and_pull_of_any_committed_checkpoint(
    two: Stack, tmp_path: Path
) -> None:
    """On two trainers: the run rolled back, and the same job never interrupted beside it."""
    stack = two
    nc = await stack.client()
    gate, open_gate = tmp_path / "gate", tmp_path / "open"
    open_gate.touch()
    run_id = await submit(nc, gated(gate))
    straight = await submit(nc, gated(open_gate))  # the same job, never interrupted
    log = EventLog(nc, run_id)
    # Three checkpoints before the gate. Which steps they are is the runtime's to say (a
    # checkpoint due while the last is still being written waits for the next step), so
    # everything below is read from what was committed.
    await log.wait_for(
        lambda e: len(log.of(CheckpointCommitted)) >= 3, 120, "three checkpoints committed"
    )
    first = log.of(Started)[0].token
    s1, target = sorted(e.step for e in log.of(CheckpointCommitted))[:2]

    # Refused before anything is asked: no checkpoint at that step.
    code, _, err = await baton(stack, "rollback", run_id, "--step", "7")
    assert code == 3 and "no committed checkpoint at step 7" in err, (code, err)
    # The dispatcher refuses the same request on its own: dead-lettered, nothing changed.
    await nc.jetstream().publish(
        names.steer_subject(run_id), encode(Rollback(run_id=run_id, step=7)),
        headers={"Nats-Msg-Id": f"bogus-rollback.{run_id}"},
    )  # fmt: skip
    letter = await eventually(lambda: _letter(nc, "step 7"), 30, "the refused rollback")
    assert run_id in letter.reason and "steps available: " in letter.reason, letter
    assert (await as_json(stack, "status", run_id))["rollback_to"] is None

    # (a) Back to `target`: the attempt stops without a checkpoint, the next one rewinds
    # `latest` under its own token and goes on from there.
    done = await as_json(stack, "rollback", run_id, "--step", str(target), "--reason", "bad data")
    assert done["outcome"] == "done", done
    (rewind,) = done["record"]["rewinds"]
    assert rewind["to_step"] == target and rewind["token"] > first, rewind
    assert rewind["reason"] == "bad data" and rewind["from_step"] > target, rewind
    abandoned = rewind["abandoned"]
    assert abandoned and abandoned == sorted(abandoned, reverse=True), rewind
    assert abandoned[0] == rewind["from_step"] and min(abandoned) > target, rewind
    rolled = await log.wait_for(lambda e: isinstance(e, RolledBack), 30, "rolled_back")
    assert isinstance(rolled, RolledBack) and rolled.abandoned == abandoned, rolled
    stopped = log.of(Preempted)
    assert stopped and f"rolled back to step {target}: bad data" in stopped[-1].reason, stopped
    again = [e for e in log.of(Started) if e.token == rewind["token"]]
    assert again and again[0].start_step == target, log.of(Started)

    rows = await as_json(stack, "checkpoints", run_id)
    mine = {r["step"]: r for r in rows if r["token"] == first}
    assert sorted(mine) == sorted([s1, target, *abandoned]), rows  # every one, once
    assert {s: r["status"] for s, r in mine.items()} == {
        s1: "chain", target: "chain", **{s: "abandoned" for s in abandoned}
    }, rows  # fmt: skip
    base_digest = mine[target]["digest"]
    assert base_digest, rows

    # (c) Any committed checkpoint still stored can be pulled, its status said (the run
    # may have committed the same step again since: `--token` names the abandoned one).
    gone = abandoned[-1]
    pulled = await as_json(
        stack, "pull", run_id, str(tmp_path / "gone"), "--step", str(gone), "--token", str(first)
    )
    assert (pulled["step"], pulled["token"], pulled["status"]) == (gone, first, "abandoned"), pulled
    assert pulled["digest"] == mine[gone]["digest"], pulled
    assert (tmp_path / "gone" / "model.safetensors").is_file()
    pulled = await as_json(stack, "pull", run_id, str(tmp_path / "base"), "--step", str(target))
    assert (pulled["status"], pulled["digest"]) == ("chain", base_digest), pulled
    code, _, err = await baton(stack, "pull", run_id, str(tmp_path / "p7"), "--step", "7")
    assert code == 3 and "no committed checkpoint at step 7" in err, (code, err)

    # (b) A fork from `target` with another learning rate (and no gate).
    forked = await as_json(
        stack, "fork", run_id, "--step", str(target), "--set", "config.lr=0.01",
        "--set", "config.gate_at=-1",
    )  # fmt: skip
    fork_id = forked["run_id"]
    assert forked["answer"] == "accepted" and fork_id != run_id, forked

    gate.touch()
    ended = await finished(nc, run_id, timeout=180)
    uninterrupted = await finished(nc, straight, timeout=180)
    fork = await finished(nc, fork_id, timeout=180)
    assert ended.state is uninterrupted.state is fork.state is RunState.COMPLETED, (ended, fork)
    # Exact resume across the rollback: the same weights as the run never interrupted.
    assert ended.digest == uninterrupted.digest, (ended.digest, uninterrupted.digest)

    # The abandoned checkpoints were never restored, and are listed so to the end.
    async with open_store(stack.store_url) as store:
        chain = {commit.key_of(m) for m in await retention.committed_chain(store, run_id)}
        dropped = await retention.abandoned(store, run_id)
        restored, _ = await commit.restorable(store, run_id)
    assert dropped == {commit.manifest_key(run_id, s, first) for s in abandoned}, dropped
    assert not chain & dropped and restored is not None and restored.final, (chain, restored)
    rows = await as_json(stack, "checkpoints", run_id)
    assert {(r["token"], r["step"]) for r in rows if r["status"] == "abandoned"} == {
        (first, s) for s in abandoned
    }, rows  # fmt: skip
    code, out, err = await baton(stack, "status", run_id)
    assert code == 0 and f"{rewind['from_step']} → {target}" in out, (out, err)

    # The fork restored the parent's bits at `target`, exactly; then trained its own way.
    code, out, err = await baton(stack, "logs", fork_id)
    assert code == 0, err
    assert re.search(rf"restored step {target} digest {base_digest}\b", out), out[-2000:]
    fork_log = EventLog(nc, fork_id)
    grafted = await fork_log.wait_for(lambda e: isinstance(e, Forked), 30, "forked")
    assert isinstance(grafted, Forked), grafted
    assert (grafted.parent, grafted.step, grafted.digest) == (run_id, target, base_digest)
    assert fork.spec.fork is not None and fork.spec.config["lr"] == 0.01, fork.spec
    assert fork.digest != ended.digest, "the fork trained with its own learning rate"
    fork_rows = await as_json(stack, "checkpoints", fork_id)
    base = next(r for r in fork_rows if r["step"] == target)
    assert base["digest"] == base_digest and base["status"] == "chain", fork_rows
    code, out, err = await baton(stack, "status", fork_id)
    assert code == 0 and f"forked from {run_id} at step {target}" in out, (out, err)

    # A run that is over goes back only by a fork.
    code, _, err = await baton(stack, "rollback", run_id, "--step", str(target))
    assert code == 2 and "fork it instead" in err, (code, err)

    # The whole history keeps every invariant (docs/verify.md): the rollback's note, the
    # abandoned checkpoints off the chain, the fork's graft, each run's end.
    code, out, err = await baton(stack, "verify")
    assert code == 0 and out.startswith("no violation"), (code, out, err)
    verdict = await as_json(stack, "verify")
    assert verdict["ok"] and verdict["violations"] == [] and verdict["runs"] >= 3, verdict
    log.close()
    fork_log.close()


async def _letter(nc: Any, needle: str) -> DeadLetter | None:
    js = nc.jetstream()
    info = await js.stream_info(names.DLQ_STREAM)
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(names.DLQ_STREAM, seq)
        except Exception:
            continue
        if msg.data is None:
            continue
        letter = decode(msg.data, DeadLetter)
        if needle in letter.reason:
            return letter
    return None
