"""Proof 2, the zygote and the GPU; and what nvidia-smi says of the GPU and its processes.

A trainer's zygote imports torch and nothing else: it must never have initialised CUDA (no
GPU device file open, no process of it on the GPU), and a training process forked from it
initialises CUDA itself. When the trainer is SIGKILLed, its training process dies
with it (parent-death signals) and the driver takes back the device memory it held: the
time until nvidia-smi shows no process of it and the memory back is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from bench.gpu.report import Proving
from bench.gpu.sizes import Sizes
from bench.gpu.stack import Up
from shared.contracts.events import Started
from tests.e2e.jobs import EventLog, job, submit
from tests.support.stack import alive, eventually

FREED_GOAL_S = 7.0
"""The bound the GPU memory of a killed attempt must be free again within. A data loader
worker forked after CUDA was initialised shares the driver's handles of its training process
and outlives it until torch's watchdog notices, at most 5 s
(`torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL`): the memory may be held that long."""
GONE_S = 15.0
"""How long the killed trainer's processes may take to be gone (in every mode)."""


def smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV answer to `query` (`--query-gpu=…`), one list per line; none
    where there is no nvidia-smi."""
    found = shutil.which("nvidia-smi")
    if found is None:
        return []
    out = subprocess.run(
        [found, *query, "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=20, check=True,
    ).stdout  # fmt: skip
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def memory_used_mib() -> int:
    return sum(int(row[0]) for row in smi("--query-gpu=memory.used"))


def gpu_pids() -> set[int]:
    """pids of processes holding a CUDA context, as the driver reports them (in a container
    these may be the host's pids, which then match none of ours)."""
    return {int(row[0]) for row in smi("--query-compute-apps=pid") if row and row[0].isdigit()}


def gpu_handles(pid: int) -> list[str]:
    """The GPU device files the process has open: `cuInit` opens them, and a process with a
    CUDA context has its GPU's open. (Not the driver library being mapped: importing torch
    loads `libcuda` already — cuBLASLt opens it — without initialising anything.)"""
    found = []
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if (target := os.readlink(fd)).startswith("/dev/nvidia"):
                    found.append(target)
    return sorted(set(found))


async def zygote(up: Up, sizes: Sizes, p: Proving, gpu: bool) -> None:
    baseline = memory_used_mib() if gpu else 0
    out = up.root / f"hold-{uuid.uuid4().hex[:8]}.json"
    spec = job(
        name="gpu-zygote", entry_point="bench.gpu.jobs:hold", total_steps=3000, seed=1,
        deterministic=False, checkpoint={"every_steps": None},
        config={"hold_mib": sizes.hold_mib, "out": str(out)},
        limits={"max_retries": 0}, on_failure="fail_fast",
    )  # fmt: skip
    run_id = await submit(up.nats(), spec)
    log = EventLog(up.nats(), run_id)
    try:
        started = await log.wait_for(lambda e: isinstance(e, Started), 60, "the attempt")
        assert isinstance(started, Started)
        await eventually(lambda: _exists(out), 60, "the training process to hold its memory")
        found = json.loads(out.read_text())
        worker, child = started.worker, int(found["pid"])
        zygote_pid = up.zygote(worker)
        p.check(zygote_pid is not None and found["ppid"] == zygote_pid,
                "the training process was forked from its trainer's zygote",
                f"parent {found['ppid']}, zygote {zygote_pid}")  # fmt: skip
        p.check(not found["cuda_initialised_at_start"] and not found["bad_fork"],
                "CUDA was not initialised in it when it started (nothing inherited)",
                found)  # fmt: skip
        p.check(found["backend"] == ("nccl" if gpu else "gloo") and found["all_reduce"] == 8.0,
                "a one-rank group on the backend Baton picks, an all-reduce on the device",
                found.get("group_error") or f"{found['backend']} on {found['device']}")  # fmt: skip
        p.figure("backend", found["backend"])
        if gpu:
            _on_gpu(p, found, zygote_pid, child, baseline, sizes.hold_mib)
        visible = gpu and child in gpu_pids()
        await _killed(up, p, worker, [child], found["workers"], baseline, gpu, visible)
    finally:
        log.close()


def _on_gpu(
    p: Proving, found: dict[str, Any], zygote_pid: int | None, child: int, baseline: int,
    hold_mib: int,
) -> None:  # fmt: skip
    pids = gpu_pids()
    # In a container nvidia-smi may list the host's pids: then only the memory tells.
    p.figure("gpu_pids_visible", child in pids)
    mine = gpu_handles(child)
    p.check(found["cuda_initialised_after"] is True and bool(mine),
            "the training process initialised CUDA itself", mine)  # fmt: skip
    theirs = gpu_handles(zygote_pid) if zygote_pid is not None else ["(no zygote)"]
    p.check(not theirs and zygote_pid not in pids,
            "the zygote never initialised CUDA (no GPU device open, not on the GPU)",
            theirs)  # fmt: skip
    loaders = found["workers"]
    p.figure("loader_worker_holds_gpu_files", any(gpu_handles(w) for w in loaders))
    used = memory_used_mib()
    p.figure("held_mib", used - baseline)
    p.check(used - baseline >= hold_mib, "the GPU holds the training process's memory",
            f"{used - baseline} MiB over {baseline} MiB before it started")  # fmt: skip


async def _killed(
    up: Up, p: Proving, worker: str, child: list[int], loaders: list[int], baseline: int,
    gpu: bool, visible: bool,
) -> None:  # fmt: skip
    """SIGKILL the trainer; time until the training process is gone, its data loader
    workers too (torch's own watchdog ends them), nvidia-smi lists none of them, and the
    GPU's memory is back within a tenth of what the attempt held."""
    peak = memory_used_mib() if gpu else 0
    p.figure("loader_workers", len(loaders))
    family = up.kill(worker)
    killed = time.monotonic()
    times: dict[str, float] = {}
    watched = {"training_process_gone_s", "processes_gone_s"}
    watched |= {"gpu_memory_freed_s"} if gpu else set()
    watched |= {"gpu_processes_gone_s"} if visible else set()
    while time.monotonic() - killed < GONE_S and set(times) != watched:
        now = time.monotonic() - killed
        seen = {
            "training_process_gone_s": not any(alive(pid) for pid in child),
            "processes_gone_s": not any(alive(pid) for pid in family + loaders),
        }
        if visible:
            seen["gpu_processes_gone_s"] = not set(family + loaders) & gpu_pids()
        if gpu:
            seen["gpu_memory_freed_s"] = memory_used_mib() - baseline <= (peak - baseline) / 10
        for name, done in seen.items():
            if done and name not in times:
                times[name] = now
        await asyncio.sleep(0.05)
    for name in sorted(watched):
        p.figure(name, times.get(name, -1.0))
    p.check("processes_gone_s" in times, "the killed trainer's processes are all gone",
            f"{times['processes_gone_s']:.2f} s after the SIGKILL (the training process: "
            f"{times.get('training_process_gone_s', -1):.2f} s)" if "processes_gone_s" in times
            else f"not after {GONE_S:g} s")  # fmt: skip
    if gpu:
        gone, freed = times.get("gpu_processes_gone_s"), times.get("gpu_memory_freed_s")
        if visible:
            p.check(gone is not None, "nvidia-smi shows no process of the killed attempt",
                    f"{gone:.2f} s" if gone is not None else "still listed")  # fmt: skip
        p.check(freed is not None, "the GPU memory the attempt held is free again",
                f"{freed:.2f} s after the SIGKILL" if freed is not None
                else f"not after {GONE_S:g} s")  # fmt: skip
        p.goal(freed is not None and freed <= FREED_GOAL_S,
               f"its GPU memory is free again within {FREED_GOAL_S:g} s",
               f"{freed:.2f} s" if freed is not None else "not freed")  # fmt: skip


async def _exists(path: Path) -> bool:
    return path.exists()
