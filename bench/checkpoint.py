"""Checkpoint cost, as ratios against baselines measured in the same run.

1. Stall: how long the training loop is blocked per checkpoint, divided by the time the
   same bytes take to copy into preallocated host memory (the floor for any snapshot).
   Target <= 1.5 for states of 10 MB, 100 MB and 1 GB.
2. Overhead: steps/s with a checkpoint every 10 s, divided by steps/s with none, for the
   same model in the same process. Target >= 0.99.

    .venv/bin/python -m bench.checkpoint [--sizes 10,100,1000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from baton.runtime.context import RunContext
from baton.runtime.snapshot import Snapshotter
from shared.contracts import JobSpec, Task, convert


def copy_bandwidth(tensors: dict[str, torch.Tensor], repeats: int = 5) -> float:
    """Bytes/s of copying `tensors` into buffers allocated once and reused."""
    bufs = {k: torch.empty_like(v, device="cpu") for k, v in tensors.items()}
    for k, v in tensors.items():
        bufs[k].copy_(v)  # first touch: page faults belong to allocation, not to copying
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for k, v in tensors.items():
            bufs[k].copy_(v)
        times.append(time.perf_counter() - t)
    size = sum(v.numel() * v.element_size() for v in tensors.values())
    return size / statistics.median(times)


def stall(size_mb: int, store: Path, repeats: int = 4) -> tuple[float, float, float]:
    """(median stall s, ideal copy s, background write s) for a state of `size_mb`."""
    n = size_mb * 1024 * 1024 // 4
    chunks = 8
    tensors = {f"w{i}": torch.randn(n // chunks) for i in range(chunks)}
    ideal = sum(t.numel() * 4 for t in tensors.values()) / copy_bandwidth(tensors)
    snap = Snapshotter(f"file://{store}", store / ".spool")
    stalls, writes = [], []
    run = uuid.uuid4().hex[:8]
    for step in range(repeats + 1):
        for t in tensors.values():
            t.add_(1.0)  # training changed the weights since the last checkpoint
        s, blocked = snap.capture(step, {"model": tensors}, {"step": step})
        done: list[float] = []
        t0 = time.perf_counter()

        def finished(_files: object, t0: float = t0, done: list[float] = done) -> None:
            done.append(time.perf_counter() - t0)

        snap.write_async(s, f"bench{run}", 1, finished, print)
        snap.wait()  # the checkpoint interval is longer than a write: no back-pressure
        if step:  # the first capture allocates the buffers; report the steady state
            stalls.append(blocked)
            writes.append(done[0])
    snap.close()
    return statistics.median(stalls), ideal, statistics.median(writes)


def overhead(seconds: float, store: Path) -> tuple[float, float, int]:
    """(steps/s without checkpoints, steps/s with one every 10 s, checkpoints taken)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(
        nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(256, 512), torch.randn(256, 1)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    def rate(every_seconds: float | None) -> tuple[float, int]:
        spec = convert(
            {
                "name": "bench",
                "entry_point": "bench.checkpoint:step",
                "total_steps": 10**9,
                "checkpoint": {"every_steps": None, "every_seconds": every_seconds},
            },
            JobSpec,
        )
        task = Task(run_id=f"b{uuid.uuid4().hex[:10]}", spec=spec)
        sent: list[object] = []
        ctx = RunContext(task, 1, f"file://{store}", store / ".spool", sent.append)
        ctx.restore(model=model, optimizer=opt)
        steps = 0
        t0 = time.perf_counter()
        for _ in ctx.steps():
            step()
            steps += 1
            if time.perf_counter() - t0 >= seconds:
                break
        elapsed = time.perf_counter() - t0
        ctx._checkpoints.close()
        return steps / elapsed, sum(type(m).__name__ == "CheckpointReady" for m in sent)

    for _ in range(5):
        step()  # warm up allocator and kernels outside both measurements
    base, _ = rate(None)
    with_ckpt, taken = rate(10.0)
    return base, with_ckpt, taken


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,100,1000", help="state sizes in MB")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each overhead run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        store = Path(tmp)
        print("checkpoint stall (training loop blocked) vs copy into preallocated host memory")
        print(f"{'state':>8} {'stall ms':>9} {'copy ms':>8} {'ratio':>6} {'bg write ms':>12}")
        for mb in (int(s) for s in args.sizes.split(",")):
            blocked, ideal, write = stall(mb, store)
            ratio = blocked / ideal
            print(
                f"{mb:>6}MB {blocked * 1e3:>9.1f} {ideal * 1e3:>8.1f} {ratio:>6.2f}"
                f" {write * 1e3:>12.1f}"
            )
        base, with_ckpt, taken = overhead(args.seconds, store)
        print(
            f"\nsteps/s: {base:.2f} without checkpoints, {with_ckpt:.2f} with one every 10 s "
            f"({taken} taken); ratio {with_ckpt / base:.3f}"
        )


if __name__ == "__main__":
    main()
