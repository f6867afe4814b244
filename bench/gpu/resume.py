"""Proofs 1 and 5: a run whose trainer is SIGKILLed between two checkpoints is resumed by
another trainer and ends on the same bits as a run of the same job that was never stopped —
Baton's own loop (a GPT, deterministic, bf16 autocast), once from the last commit and once
from a local snapshot ahead of it; and the Hugging Face Trainer (a Llama, bf16).

The reference and the interrupted runs train side by side on the one GPU (a trainer each);
every run's weights digest is what its final checkpoint holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from baton.runtime.local import MARK, Mark
from bench.gpu.report import Proving
from bench.gpu.sizes import Sizes
from bench.gpu.stack import Up
from shared.checkpoint import commit
from shared.checkpoint.store import open_store
from shared.contracts import JobSpec, RunState
from shared.contracts.events import (
    CheckpointCommitted,
    Completed,
    Diverged,
    Progress,
    Restored,
    Started,
)
from tests.e2e.jobs import EventLog, finished, job, submit
from tests.support.stack import alive, eventually

PACE_S = 0.1
"""Seconds a step waits (no arithmetic changes): an interval between two checkpoints lasts
seconds, so a kill lands inside it, and a local snapshot is taken inside it."""


async def exact(up: Up, sizes: Sizes, p: Proving, gpu: bool, deadline: float) -> None:
    every, total = sizes.exact_every, sizes.exact_steps
    config = sizes.exact.config(pace=PACE_S)

    def spec(role: str, **checkpoint: Any) -> JobSpec:
        return job(
            name=f"gpt-{role}", entry_point="bench.gpu.jobs:exact", total_steps=total, seed=7,
            deterministic=True, checkpoint={"every_steps": every, "keep_last": 1, **checkpoint},
            config=config, idempotency_key=f"gpu-exact-{role}-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip

    nc = up.nats()
    ref = await submit(nc, spec("reference"))
    killed = await submit(nc, spec("killed"))
    local = await submit(nc, spec("local", local_every_seconds=0))
    logs = {run: EventLog(nc, run) for run in (ref, killed, local)}
    try:
        # Side by side: the second kill waits for the first run to be resumed, so that the
        # trainer free for it is the first one's, restarted, and never its own. (A task
        # group: one failing, the other is stopped, never left to kill a trainer later.)
        async with asyncio.TaskGroup() as tg:
            first = tg.create_task(_kill_between(up, logs[killed], every, p, "commit"))
            second = tg.create_task(
                _kill_between(up, logs[local], every, p, "local", after=logs[killed])
            )
        at, at_local = first.result(), second.result()
        records = {}
        for run in (ref, killed, local):
            records[run] = await finished(nc, run, timeout=max(10.0, deadline - time.monotonic()))
        want = records[ref].digest or ""
        p.figure("digest", want[:16])
        for run, how, tag, kill in (
            (killed, "from its newest commit", "commit", at),
            (local, "from a local snapshot", "local", at_local),
        ):  # fmt: skip
            rec = records[run]
            p.check(rec.state is RunState.COMPLETED and rec.digest == want,
                    f"killed at step {kill[1]}, resumed {how}: bitwise the uninterrupted run",
                    f"{rec.state.value}, digest {(rec.digest or '')[:16]}")  # fmt: skip
            _resumed(p, logs[run], kill, every, tag, local=tag == "local")
        for run, log in logs.items():
            p.check(not log.of(Diverged), f"{run}: the self-check saw no resumed step differ")
        keys = await rng_keys(up.store_url, ref)
        want_rng = "cuda.0" if gpu else "torch"
        p.check(want_rng in keys, f"the checkpoint carries the generators' states ({want_rng})",
                keys)  # fmt: skip
    finally:
        for log in logs.values():
            log.close()
        up.forget(ref, killed, local)


async def framework(up: Up, sizes: Sizes, p: Proving, deadline: float) -> None:
    every = sizes.llama_every

    def spec(role: str) -> JobSpec:
        return job(
            name=f"llama-{role}", entry_point="bench.gpu.llama:train",
            total_steps=sizes.llama_steps, seed=42, deterministic=True,
            checkpoint={"every_steps": every, "keep_last": 1},
            config=sizes.llama.config(pace=PACE_S),
            idempotency_key=f"gpu-hf-{role}-{uuid.uuid4().hex[:8]}",
        )  # fmt: skip

    nc = up.nats()
    ref, killed = await submit(nc, spec("reference")), await submit(nc, spec("killed"))
    log = EventLog(nc, killed)
    try:
        kill = await _kill_between(up, log, every, p, "commit")
        left = max(10.0, deadline - time.monotonic())
        a, b = await finished(nc, ref, timeout=left), await finished(nc, killed, timeout=left)
        p.figure("digest", (a.digest or "")[:16])
        p.check(a.state is RunState.COMPLETED and b.state is RunState.COMPLETED
                and a.digest == b.digest,
                f"the Trainer killed at step {kill[1]}, resumed: bitwise the uninterrupted run",
                f"{a.state.value} {a.digest}, {b.state.value} {b.digest}")  # fmt: skip
        _resumed(p, log, kill, every, "commit", local=False)
        p.check(not log.of(Diverged), "the self-check saw no resumed step differ")
    finally:
        log.close()
        up.forget(ref, killed)


async def _kill_between(
    up: Up, log: EventLog, every: int, p: Proving, tag: str, after: EventLog | None = None
) -> tuple[str, int, int]:
    """Once the run has committed a checkpoint and is halfway to its next one (`local`
    runs: once a local snapshot past its newest commit exists), SIGKILL the trainer holding
    it, another one being free (and `after`'s run resumed). Returns the trainer, the last
    step it reported, its newest commit then."""
    local = after is not None
    first = await log.wait_for(lambda e: isinstance(e, Started), 120, "the run to start")
    assert isinstance(first, Started)
    if after is not None:
        await after.wait_for(lambda e: isinstance(e, Restored) and e.step > 0, 180, "resumed")
    await log.wait_for(lambda e: isinstance(e, CheckpointCommitted), 180, "a commit")
    await up.idle_besides(first.worker)
    while True:
        if log.of(Completed):
            raise RuntimeError(f"{log.run_id} completed before it could be killed mid-way")
        commit_at = max(e.step for e in log.of(CheckpointCommitted))
        if local:
            ahead = await _snapshot_after(up.root, log.run_id, commit_at)
        else:
            ahead = max(e.step for e in log.of(Progress)) >= commit_at + every // 2
        if ahead:
            break
        await asyncio.sleep(0.05)
    step = max(e.step for e in log.of(Progress))
    family = up.kill(first.worker)
    killed = time.monotonic()
    await eventually(lambda: _none_alive(family), 15, "the killed trainer's processes")
    p.figure(f"{tag}_killed_at_step", step)
    p.figure(f"{tag}_processes_gone_s", time.monotonic() - killed)
    return first.worker, step, commit_at


def _resumed(
    p: Proving, log: EventLog, killed: tuple[str, int, int], every: int, tag: str, local: bool
) -> None:
    """The attempt after the kill: another trainer, resumed at a commit no older than the
    newest one before the kill, before the step the killed attempt reached (or, from a
    local snapshot, past that commit)."""
    worker, step, commit_at = killed
    again = [e for e in log.of(Restored) if e.worker != worker]
    if not p.check(bool(again), "resumed by another trainer", [e.worker for e in log.of(Restored)]):
        return
    r = again[0]
    p.figure(f"{tag}_resumed_at_step", r.step)
    p.figure(f"{tag}_restore_s", r.restore_s)
    if local:
        p.check(r.local and r.step > commit_at,
                "resumed from the local snapshot, past the newest commit",
                f"step {r.step}, local {r.local}; newest commit {commit_at}")  # fmt: skip
    else:
        p.check(not r.local and commit_at <= r.step < step and r.step % every == 0,
                "resumed from the newest commit; the steps since it trained again",
                f"step {r.step}; newest commit {commit_at}, reached {step}")  # fmt: skip
    first = next((e for e in log.of(Progress) if e.worker == r.worker), None)
    last = [e.at for e in log.of(Progress) if e.worker == worker]
    if first is not None and last:
        p.figure(f"{tag}_last_to_resumed_step_s", first.at - max(last))


async def rng_keys(store_url: str, run_id: str) -> list[str]:
    """The names in the run's newest checkpoint's `rng` file (a safetensors header)."""
    async with open_store(store_url) as store:
        latest = await commit.read_latest(store, run_id)
        assert latest is not None, f"{run_id} has no checkpoint"
        manifest = await commit.load_manifest(store, latest[0].manifest)
        ref = next(f for f in manifest.files if f.name == "rng.safetensors")
        raw = await store.get(ref.key)
    (size,) = struct.unpack("<Q", raw[:8])
    return sorted(k for k in json.loads(raw[8 : 8 + size]) if k != "__metadata__")


def _snapshots(root: Path, run_id: str) -> Iterator[int]:
    """The steps of `run_id`'s local snapshots on this host (`Up`'s `BATON_SNAPSHOTS`)."""
    for mark in (root / "snapshots").glob(f"*/snap-*/{MARK}"):
        with contextlib.suppress(OSError, ValueError):  # removed, or not yet whole
            found = msgspec.json.decode(mark.read_bytes(), type=Mark)
            if found.run_id == run_id:
                yield found.step


async def _snapshot_after(root: Path, run_id: str, step: int) -> int | None:
    return max((s for s in _snapshots(root, run_id) if s > step), default=None)


async def _none_alive(pids: list[int]) -> bool:
    return not any(alive(pid) for pid in pids)
