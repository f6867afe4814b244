"""The cost of exactness: training steps/s with `baton.runtime.exact.DataParallel` against
plain `DistributedDataParallel`, same model, same data, same global batch, at 1 and 2 ranks.
Ratios are exact/DDP measured in the same run.

    .venv/bin/python -m bench.elastic [--hidden 256,1024] [--batch 32] [--shards 2]
                                      [--steps 60] [--warmup 5] [--rounds 3] [--threads 1]

Every rank is a process of its own (this file, `--worker`), in a gloo group on loopback —
DDP at 1 rank too (a 1-process group), so both sides pay the same machinery. The model is an
MLP (8 -> hidden -> hidden -> 4, ReLU, dropout) with AdamW; the global batch is `shards` ×
`batch` samples, read from a map-style dataset and collated the same way on both sides:

* exact: `shards` virtual shards of `batch` samples; a rank computes its shards one forward
  and backward each, `sync()` all-gathers the shards' gradients and sums them in order;
* DDP: each rank one forward and backward over its `shards × batch / ranks` samples, DDP's
  bucketed all-reduce overlapping the backward.

Each process runs `--warmup` steps, a barrier, then `--steps` timed steps; rank 0's clock
counts. The modes and sizes take turns, `--rounds` times (median). Each process uses
`--threads` threads (1, as a deterministic run's training process does), so 2 ranks use both
cores of a 2-core machine and the 1-rank runs one. The last lines say whether the final
weights were the same bits at 1 and 2 ranks, for each way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, default_collate

from baton.runtime.exact import DataParallel
from bench.data_resume import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
DIM, CLASSES = 8, 4


class Points(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def worker(cfg: dict[str, Any]) -> None:
    """One rank: train, time, print one JSON line (rank 0)."""
    torch.set_num_threads(cfg["threads"])
    rank, world, hidden = cfg["rank"], cfg["world"], cfg["hidden"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(DIM, hidden), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shards, batch = cfg["shards"], cfg["batch"]
    data = Points(shards * batch * 64)
    dp = DataParallel(model, data, batch_size=batch, shards=shards, seed=0, rank=rank,
                      world_size=world)  # fmt: skip
    ddp = DistributedDataParallel(model) if cfg["mode"] == "ddp" else None
    if ddp is not None:
        torch.manual_seed(1 + rank)  # each rank's own dropout masks

    def step(s: int) -> None:
        if ddp is None:
            for shard in dp.shards(s):
                x, y = shard.batch
                shard.backward(nn.functional.cross_entropy(model(x), y))
            dp.sync()
        else:  # this rank's contiguous share of the same global batch
            share = [i for v in range(shards) for i in dp.indices(s, v)]
            per = len(share) // world
            x, y = default_collate([data[i] for i in share[rank * per : (rank + 1) * per]])
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    for s in range(cfg["warmup"]):
        step(s)
    dist.barrier()
    began = time.perf_counter()
    for s in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        step(s)
    dist.barrier()
    took = time.perf_counter() - began
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        print(json.dumps({"steps_s": cfg["steps"] / took, "digest": digest.hexdigest()[:16],
                          "params": sum(p.numel() for p in model.parameters())}))  # fmt: skip
    dist.destroy_process_group()


def measure(mode: str, world: int, hidden: int, a: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(world):
            cfg = {"mode": mode, "rank": rank, "world": world, "port": port, "hidden": hidden,
                   "batch": a.batch, "shards": a.shards, "steps": a.steps, "warmup": a.warmup,
                   "threads": a.threads}  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.elastic", "--worker", json.dumps(cfg)],
                cwd=ROOT, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        out, _ = procs[0].communicate(timeout=600)
        for p in procs:
            if p.wait(timeout=60) != 0:
                raise RuntimeError(f"{mode} at {world} ranks: a rank exited {p.returncode}")
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def main(a: argparse.Namespace) -> None:
    began, cpu_start = time.perf_counter(), cpu_seconds()
    hiddens = [int(h) for h in a.hidden.split(",")]
    worlds = (1, 2)
    runs: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for _ in range(a.rounds):  # interleaved, so drift on the machine hits every case alike
        for hidden in hiddens:
            for world in worlds:
                for mode in ("ddp", "exact"):
                    runs.setdefault((hidden, world, mode), []).append(
                        measure(mode, world, hidden, a)
                    )
    print(f"global batch {a.shards} x {a.batch}, {a.threads} thread(s) per rank, "
          f"{a.steps} timed steps, median of {a.rounds}")  # fmt: skip
    print("| hidden | params | ranks | DDP steps/s | exact steps/s | exact/DDP |")
    print("| --- | --- | --- | --- | --- | --- |")
    for hidden in hiddens:
        for world in worlds:
            ddp = statistics.median(r["steps_s"] for r in runs[(hidden, world, "ddp")])
            exact = statistics.median(r["steps_s"] for r in runs[(hidden, world, "exact")])
            params = runs[(hidden, world, "ddp")][0]["params"]
            print(f"| {hidden} | {params:,} | {world} | {ddp:.1f} | {exact:.1f} | "
                  f"{exact / ddp:.2f} |")  # fmt: skip
    for hidden in hiddens:
        for mode in ("exact", "ddp"):
            digests = {w: {r["digest"] for r in runs[(hidden, w, mode)]} for w in worlds}
            same = len(digests[1] | digests[2]) == 1
            print(f"hidden {hidden}, {mode}: final weights at 1 and 2 ranks "
                  f"{'the same bits' if same else 'differ'} {digests}")  # fmt: skip
    wall, cpu_end = time.perf_counter() - began, cpu_seconds()
    others = ""
    if cpu_start is not None and cpu_end is not None:
        other_s = max(0.0, (cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1]))
        cores = os.cpu_count() or 1
        others = (f"; other processes used {other_s:.1f} CPU-s of the machine's "
                  f"{cores * wall:.0f} ({100 * other_s / (cores * wall):.0f} %)")  # fmt: skip
    print(f"total {wall:.1f} s{others}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--hidden", default="256,1024", help="hidden widths to measure")
    ap.add_argument("--batch", type=int, default=32, help="samples per virtual shard")
    ap.add_argument("--shards", type=int, default=2, help="virtual shards (the max ranks)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
    else:
        main(args)
