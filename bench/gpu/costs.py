"""Proofs 3 and 4: what Baton costs a GPU run — a large model's checkpoint (the loop's stall,
the snapshot's copy against the pinned-copy limit, the write to the store) and the steps/s
of a run under Baton against the same loop run bare. Each figure against its baseline,
measured in the same run: these are the ratios the goals are stated in."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.gpu.report import Proving
from bench.gpu.sizes import Sizes
from bench.gpu.stack import Up
from shared.contracts import RunState
from shared.contracts.events import CheckpointCommitted
from tests.e2e.jobs import EventLog, finished, job, submit

COPY_GOAL = 1.5
"""The snapshot's device-to-host copy, at most this many times the pinned-copy limit."""
RATE_GOAL = 0.98
"""Steps/s under Baton, at least this fraction of the same loop's bare."""
GB = 1e9


async def cost(up: Up, sizes: Sizes, p: Proving, gpu: bool, deadline: float) -> None:
    out = up.root / f"cost-{uuid.uuid4().hex[:8]}.json"
    spec = job(
        name="gpt-cost", entry_point="bench.gpu.jobs:cost", total_steps=sizes.cost_steps,
        seed=5, deterministic=False, checkpoint={"every_steps": None, "keep_last": 1},
        config=sizes.cost.config(out=str(out)),
    )  # fmt: skip
    run_id = await submit(up.nats(), spec)
    log = EventLog(up.nats(), run_id)
    try:
        rec = await finished(up.nats(), run_id, timeout=max(10.0, deadline - time.monotonic()))
    finally:
        log.close()
    if not p.check(rec.state is RunState.COMPLETED and out.exists(), "the run completed",
                   f"{rec.state.value} {rec.reason or ''}"):  # fmt: skip
        return
    found = json.loads(out.read_text())
    up.forget(run_id)
    judge_copies(p, found, gpu)
    judge_saves(p, found)
    writes = found["writes"]
    if p.check(bool(writes), "the writer stored the checkpoints"):
        rates = [b / s for s, b in writes]
        p.figure("write_GBps", statistics.median(rates) / GB)
        p.figure("write_s", statistics.median(s for s, _ in writes))
    committed = [e.bytes for e in log.of(CheckpointCommitted)]
    p.figure("checkpoints_committed", len(committed))
    p.figure("checkpoint_GB", max(committed, default=0) / GB)


def judge_copies(p: Proving, found: dict[str, Any], gpu: bool) -> None:
    """The snapshot's copies after the first (which allocates the reused buffers), against
    the limit: the same tensors into preallocated pinned memory."""
    p.figure("params", found["params"])
    p.figure("state_GB", found["state_bytes"] / GB)
    limit, copies = found["pinned_limit_s"], found["copies"]
    p.figure("pinned_copy_limit_s", limit)
    p.figure("pinned_copy_limit_GBps", found["state_bytes"] / limit / GB)
    if not p.check(len(copies) >= 2, "two snapshots or more were taken", len(copies)):
        return
    p.figure("first_copy_s", copies[0]["seconds"])
    copy = statistics.median(c["seconds"] for c in copies[1:])
    p.figure("snapshot_copy_s", copy)
    p.figure("snapshot_copy_ratio", copy / limit)
    p.goal(copy / limit <= COPY_GOAL, f"the snapshot's copy within {COPY_GOAL}x the limit",
           f"{copy * 1e3:.1f} ms against {limit * 1e3:.1f} ms: {copy / limit:.2f}x")  # fmt: skip
    if gpu:
        pinned = all(c["pinned"] and c["from_gpu"] for c in copies)
        p.check(pinned, "every snapshot copied from the GPU into pinned host buffers")


def judge_saves(p: Proving, found: dict[str, Any]) -> None:
    """The loop's stall per checkpoint (not the first, which allocates; not the final, which
    waits for the last write by design), and what it is made of."""
    steady = [s for s in found["saves"][1:] if not s["final"]]
    saves = [(s["step"], s["final"]) for s in found["saves"]]
    if not p.check(bool(steady), "a checkpoint besides the first and the final", saves):
        return
    s = steady[0]
    p.figure("stall_s", s["stall_s"])
    p.figure("stall_digest_s", s["digest_s"])
    p.figure("stall_copy_s", s["copy_s"])
    p.figure("stall_wait_s", s["wait_s"])
    p.figure("stall_rest_s", s["stall_s"] - s["digest_s"] - s["copy_s"] - s["wait_s"])
    p.figure("stall_over_limit", s["stall_s"] / found["pinned_limit_s"])
    p.figure("first_stall_s", found["saves"][0]["stall_s"])


async def overhead(up: Up, sizes: Sizes, p: Proving, env: dict[str, str], deadline: float) -> None:
    """The bare loop first, for `rate_seconds` after its warm-up; then the same number of
    steps under Baton, checkpointing every `rate_every_s` seconds."""
    config = sizes.rate.config(seed=9, warm=sizes.rate_warm, seconds=sizes.rate_seconds)
    bare = await _bare(up.root, config, env, deadline)
    steps = int(bare["steps"])
    out = up.root / f"rate-{uuid.uuid4().hex[:8]}.json"
    spec = job(
        name="gpt-rate", entry_point="bench.gpu.jobs:rate", seed=9, deterministic=False,
        total_steps=sizes.rate_warm + steps,
        checkpoint={"every_steps": None, "every_seconds": sizes.rate_every_s, "keep_last": 1},
        config={**config, "out": str(out)},
    )  # fmt: skip
    run_id = await submit(up.nats(), spec)
    log = EventLog(up.nats(), run_id)
    try:
        rec = await finished(up.nats(), run_id, timeout=max(10.0, deadline - time.monotonic()))
    finally:
        log.close()
    if not p.check(rec.state is RunState.COMPLETED and out.exists(), "the run completed",
                   f"{rec.state.value} {rec.reason or ''}"):  # fmt: skip
        return
    up.forget(run_id)
    under = json.loads(out.read_text())
    bare_rate, rate = steps / bare["seconds"], under["steps"] / under["seconds"]
    p.figure("steps", steps)
    p.figure("bare_steps_per_s", bare_rate)
    p.figure("baton_steps_per_s", rate)
    p.figure("ratio", rate / bare_rate)
    p.figure("checkpoints", len(log.of(CheckpointCommitted)))
    p.goal(rate / bare_rate >= RATE_GOAL, f"steps/s under Baton at least {RATE_GOAL} of bare",
           f"{rate:.2f} / {bare_rate:.2f} = {rate / bare_rate:.3f}, a checkpoint every "
           f"{sizes.rate_every_s:g} s")  # fmt: skip


async def _bare(root: Path, config: dict[str, Any], env: dict[str, str], deadline: float) -> Any:
    out = root / f"bare-{uuid.uuid4().hex[:8]}.json"
    # As the trainer sets up a training process's environment (services/trainer/service.py).
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1", **env}
    with (root / "bare.log").open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.gpu.jobs", "bare", json.dumps(config), str(out),
            stdout=log, stderr=log, env=env,
        )  # fmt: skip
        try:
            code = await asyncio.wait_for(proc.wait(), max(10.0, deadline - time.monotonic()))
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    if code != 0 or not out.exists():
        raise RuntimeError(f"the bare loop failed ({code}); see {root / 'bare.log'}")
    return json.loads(out.read_text())
