"""Sharded (FSDP2) checkpoints, as ratios against baselines measured in the same run.

Every rank is a process of its own (gloo, on CPU) holding its shard of a stack of
`nn.Linear(1024, 1024)` layers of `--mb` MB of weights (`fully_shard` per layer, then the
root) and of AdamW's state after one step: a checkpoint is model + optimizer, about 3x the
weights, registered as Baton registers it (`slots_for`).

1. Save, at each group size, the ranks starting together after a barrier: every rank takes
   its chunks (`Slot.capture`, `baton.runtime.shards.local`), copies them into its snapshot
   buffers (`Snapshotter.capture`: the stall, what the training loop waits for) and writes
   them to a `file://` store. Reported: all ranks' bytes over the slowest rank's time, as a
   ratio to the smallest group's, and each rank's stall (its state dicts taken, then the
   copy into its buffers: what Baton reports as the checkpoint's stall) over the time its
   bytes take to copy into preallocated host memory (`bench.checkpoint.copy_bandwidth`, all ranks at
   once, as they capture). Target stall/copy <= 1.5. The first capture allocates the
   buffers; the next 3 are timed (medians). Plain DCP's save at 2 ranks, for scale.
2. Resume: a checkpoint of 2 ranks, saved by Baton and by plain DCP (its default
   FileSystemWriter) on the same disk, loaded at 2 ranks and at the other sizes asked for:
   `load_sharded` + `Slot.put` against `dcp.load` + `set_{model,optimizer}_state_dict`,
   alternately, median of 3 of the slowest rank. Target Baton/DCP <= 1.2. The page cache is
   not dropped (it cannot be here): both read cached files. At every size the state Baton
   loaded must equal the state DCP loaded bit for bit, or the run fails.

    .venv/bin/python -m bench.sharded [--mb 300] [--ranks 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from baton.runtime.shards import load_sharded, local
from baton.runtime.slots import Slot, slots_for
from baton.runtime.snapshot import Snapshotter
from bench.checkpoint import copy_bandwidth
from shared.checkpoint.files import group_of, rank_prefix
from shared.checkpoint.tensors import flatten
from shared.contracts import FileRef, decode, encode

DIM = 1024
ROUNDS = 3
TIMEOUT_S = 900.0
"""How long one group of ranks may take before every process of it is killed."""


def layers_for(mb: int) -> int:
    return max(1, round(mb * 2**20 / (4 * DIM * (DIM + 1))))


def build(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """This rank's shard of the model (the same on every rank: one seed) and its AdamW,
    after one step on a tiny batch, so the optimizer's state exists."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(layers_for(mb))))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, DIM)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def sharded(model: nn.Module, opt: torch.optim.Optimizer) -> list[Slot]:
    return [s for s in slots_for({"model": model, "optimizer": opt}) if s.sharded]


def save(task: dict[str, Any], rank: int, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Baton checkpoints of this rank's chunks (the first one untimed: it allocates the
    buffers); with `keep`, plain DCP ones too, and what a load needs: every rank's files of
    the last Baton checkpoint and rank 0's trees. Seconds per round, and the bytes."""
    where = Path(task["dir"])
    snap = Snapshotter(f"file://{where / 'store'}", where / "spool", prefix=rank_prefix(rank))
    slots = sharded(model, opt)
    errors: list[BaseException] = []
    got: dict[str, list[float]] = {"elapsed": [], "stall": [], "prepared": [], "dcp_save": []}
    for step in range(ROUNDS + 1):
        dist.barrier()
        began = time.perf_counter()
        groups: dict[str, dict[str, torch.Tensor]] = {}
        headers: dict[str, dict[str, str]] = {}
        trees: dict[str, Any] = {}
        for slot in slots:
            whole: dict[str, torch.Tensor] = {}
            trees[slot.name] = slot.capture(whole)
            groups[slot.name], headers[slot.name] = local(whole, rank)
        prepared = time.perf_counter() - began
        captured, stall = snap.capture(step, groups, {"step": step}, headers=headers)
        files: list[FileRef] = []
        snap.write_async(captured, "bench-sharded", 1, files.extend, errors.append)
        snap.wait()
        if errors:
            raise errors[0]
        if step:
            got["elapsed"].append(time.perf_counter() - began)
            got["stall"].append(stall)
            got["prepared"].append(prepared)
    snap.close()
    chunks = {f"{g}/{k}": t for g, ts in groups.items() for k, t in ts.items()}
    size = sum(t.numel() * t.element_size() for t in chunks.values())
    dist.barrier()  # every rank copies at once, as every rank captured at once
    copy = size / copy_bandwidth(chunks)
    if task["keep"]:
        (where / "refs").mkdir(exist_ok=True)
        (where / "refs" / f"{rank}.json").write_bytes(encode(files))
        if rank == 0:
            (where / "trees.json").write_text(json.dumps(trees))
        for _ in range(ROUNDS):  # into one directory: each save replaces the last
            state = {"model": get_model_state_dict(model),
                     "optimizer": get_optimizer_state_dict(model, opt)}  # fmt: skip
            dist.barrier()
            began = time.perf_counter()
            dcp_save(state, checkpoint_id=str(where / "dcp"))
            got["dcp_save"].append(time.perf_counter() - began)
    return {**got, "bytes": sum(f.size for f in files), "copy": copy}


def spoil(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Overwrite every value a load must restore, so that a load which missed one shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(-7.0)


def gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and its optimizer, whole, on rank 0 (a collective)."""
    from torch.distributed.tensor import DTensor

    flat: dict[str, torch.Tensor] = {}
    flatten(get_model_state_dict(model), "model", flat)
    flatten(get_optimizer_state_dict(model, opt), "optimizer", flat)
    out = {}
    for name, t in flat.items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if dist.get_rank() == 0:
            out[name] = whole.detach().clone()
    return out


def same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.dtype == b.dtype and torch.equal(a, b)


def load(task: dict[str, Any], rank: int, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Seconds of each Baton and DCP load of the 2-rank checkpoint, alternately; the first
    round checks that both loaded the same bits."""
    where = Path(task["dir"])
    url = f"file://{where / 'store'}"
    files = [f for p in sorted((where / "refs").iterdir()) for f in
             decode(p.read_bytes(), list[FileRef])]  # fmt: skip
    trees = json.loads((where / "trees.json").read_text())
    slots = sharded(model, opt)

    def baton() -> None:
        for slot in slots:
            mine = [f for f in files if group_of(f.name) == slot.name]
            state, _ = load_sharded(url, mine, slot.name, trees[slot.name], slot.target())
            slot.put(state)

    def plain() -> None:
        weights, moments = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
        dcp_load({"model": weights, "optimizer": moments}, checkpoint_id=str(where / "dcp"))
        set_model_state_dict(model, weights)
        set_optimizer_state_dict(model, opt, moments)

    times: dict[str, list[float]] = {"baton": [], "dcp": []}
    reference: dict[str, torch.Tensor] = {}
    for i in range(ROUNDS):
        for name, how in (("dcp", plain), ("baton", baton)):
            spoil(model, opt)
            dist.barrier()
            began = time.perf_counter()
            how()
            times[name].append(time.perf_counter() - began)
            if i == 0 and name == "dcp":
                reference = gathered(model, opt)
            elif i == 0:
                got = gathered(model, opt)
                differ = [k for k in reference if not same(reference[k], got.get(k))]
                if rank == 0 and (differ or set(got) != set(reference)):
                    raise AssertionError(f"Baton and DCP loaded different state: {differ[:5]}")
                reference = got = {}
    return times


def worker(task_path: Path) -> None:
    """One rank of a group (`spawn`): its result as JSON in the task's `out` directory."""
    task = json.loads(task_path.read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    try:
        model, opt = build(task["mb"])
        result = (save if task["kind"] == "save" else load)(task, rank, model, opt)
        Path(task["out"], f"{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(task: dict[str, Any], world: int, tmp: Path) -> list[Any]:
    """Run `task` on `world` ranks, each a process of its own (`--worker`); their results
    by rank. Every process started is stopped before this returns, whatever happened."""
    out = tmp / f"out-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    task_path = out / "task.json"
    task_path.write_text(json.dumps({**task, "out": str(out)}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port, procs, logs = sock.getsockname()[1], [], []
    try:
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(world)}  # fmt: skip
            logs.append((out / f"{rank}.log").open("wb"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.sharded", "--worker", str(task_path)],
                env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent,
            ))  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for it forever
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in logs:
            f.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (out / f"{failed[0]}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{task['kind']} at {world} ranks: rank {failed[0]} failed\n{tail}")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def slowest(results: list[Any], key: str) -> float:
    """The median over rounds of the slowest rank's seconds in each."""
    return float(statistics.median(max(r[key][i] for r in results) for i in range(ROUNDS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="model weights, MB")
    parser.add_argument("--ranks", default="1,2,4", help="group sizes (2 is always saved)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    sizes = sorted({int(s) for s in args.ranks.split(",")} | {2})
    cores = os.cpu_count() or 1
    layers = layers_for(args.mb)
    print(f"FSDP2 on gloo, CPU only, {cores} CPU cores shared by all ranks (each rank gets"
          f" {cores}/ranks threads: more ranks than cores add no compute);"
          f" {layers} x Linear({DIM}, {DIM}) = {layers * DIM * (DIM + 1) * 4 / 2**20:.0f} MB"
          " of weights, checkpoint = model + AdamW state\n")  # fmt: skip
    print(f"save: median of {ROUNDS} (after one that allocates the buffers), slowest rank each")
    print("| ranks | written | slowest save | aggregate | vs "
          f"{sizes[0]} rank | state dict | stall / copy, per rank |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        root = Path(tmp)
        base, dcp_s, baton_s = 0.0, 0.0, 0.0
        for n in sizes:
            where = root / ("resume" if n == 2 else f"save{n}")
            task = {"kind": "save", "mb": args.mb, "dir": str(where), "keep": n == 2}
            results = spawn(task, n, root)
            written = sum(r["bytes"] for r in results)
            rate = written / slowest(results, "elapsed")
            base = base or rate
            stalls = [statistics.median(r["stall"]) + statistics.median(r["prepared"])
                      for r in results]  # fmt: skip
            ratios = ", ".join(
                f"{st / r['copy']:.2f}" for st, r in zip(stalls, results, strict=True)
            )
            print(f"| {n} | {written / 2**20:.0f} MB | {slowest(results, 'elapsed'):.2f} s"
                  f" | {rate / 2**20:.0f} MB/s | {rate / base:.2f}"
                  f" | {slowest(results, 'prepared') * 1e3:.0f} ms | {ratios}"
                  f" ({'/'.join(f'{st * 1e3:.0f}' for st in stalls)} ms) |")  # fmt: skip
            if n == 2:
                dcp_s, baton_s = slowest(results, "dcp_save"), slowest(results, "elapsed")
            else:
                shutil.rmtree(where)
        print(f"\nat 2 ranks: plain DCP save {dcp_s:.2f} s, Baton capture + write {baton_s:.2f} s"
              " (median of the slowest rank's; both fsync to the same disk)\n")  # fmt: skip
        print("| saved at 2, loaded at | Baton | DCP | Baton / DCP | same bits |")
        print("| --- | --- | --- | --- | --- |")
        for n in [2] + [s for s in sizes if s != 2]:
            task = {"kind": "load", "mb": args.mb, "dir": str(root / "resume")}
            results = spawn(task, n, root)
            baton, plain = slowest(results, "baton"), slowest(results, "dcp")
            print(f"| {n} ranks | {baton:.2f} s | {plain:.2f} s | {baton / plain:.2f} | yes |")
        print(f"\nloads: median of {ROUNDS}, DCP and Baton alternately, slowest rank each;"
              " page cache warm for both (not dropped)")  # fmt: skip


if __name__ == "__main__":
    main()
