"""The proofs' entry points, run by Baton's trainers as any user's code is; and the overhead
proof's bare loop (`python -m bench.gpu.jobs bare CONFIG OUT`), the same loop without Baton.

Every entry point takes its shape from `config` (`sizes.Gpt.config`) and an `out` path:
a JSON file of what it measured or saw, written before it returns (or, for `hold`, once it
holds its memory), read by the proof that submitted it on the same host.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from baton import RunContext
from bench.gpu.models import Tokens, build, shape_of, sync, train_step
from bench.gpu.probe import Probe, pinned_limit, state_tensors


def exact(ctx: RunContext) -> None:
    """Proof 1: a GPT trained as such scripts are (a shuffling loader with a worker, pinned
    batches on a GPU, AdamW, a cosine schedule), deterministic; `pace` seconds per step
    (no arithmetic changes) keep a kill between two checkpoints within reach."""
    shape = shape_of(ctx.config)
    model, opt = build(shape, ctx.seed, ctx.device)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    data = Tokens(shape.vocab, shape.seq, shape.windows, ctx.seed)
    batches = ctx.data_loader(
        data, batch_size=shape.batch, num_workers=1, pin_memory=ctx.device.type == "cuda"
    )
    ctx.restore(model=model, optimizer=opt, scheduler=sched)
    pace, never = float(ctx.config.get("pace", 0.0)), threading.Event()
    for _ in ctx.steps():
        loss = train_step(model, opt, next(batches), ctx.device)
        sched.step()
        ctx.report(loss=loss.item())
        if pace:
            never.wait(pace)


def hold(ctx: RunContext) -> None:
    """Proof 2: what this training process finds of CUDA when it starts (it was forked from
    the trainer's warm zygote), a one-rank group on the backend Baton picks, then
    `hold_mib` of device memory held while it steps slowly, until its trainer is killed —
    with a data loader worker, forked (as they usually are) after CUDA was initialised.
    Its next attempt (its run handed over) bows out at once, before touching CUDA, and the
    run fails: nothing else may take GPU memory while the proof watches it come back."""
    if Path(ctx.config["out"]).exists():
        return
    found: dict[str, Any] = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cuda_initialised_at_start": torch.cuda.is_initialized(),  # type: ignore[no-untyped-call]
        "bad_fork": bool(torch.cuda._is_in_bad_fork()),
        "device": str(ctx.device),
    }
    try:  # its own check: whatever it finds, the memory part goes on
        found.update(one_rank_group(ctx.device))
    except Exception as exc:
        found.update(backend="", all_reduce=0.0, group_error=repr(exc))
    held = torch.ones(int(ctx.config["hold_mib"]) * 2**20, dtype=torch.uint8, device=ctx.device)
    sync(ctx.device)
    found["held_bytes"] = held.numel()
    found["cuda_initialised_after"] = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    model = nn.Linear(4, 4).to(ctx.device)
    batches = ctx.data_loader(Tokens(16, 8, 64, ctx.seed), batch_size=4, num_workers=1)
    ctx.restore(model=model)
    next(batches)  # the worker starts
    found["workers"] = _children()
    _write(ctx.config["out"], found)
    never = threading.Event()
    for _ in ctx.steps():
        next(batches)
        with torch.no_grad():
            model.weight.add_(1)
        ctx.report(held=float(held[0].item()))
        never.wait(0.1)


def one_rank_group(device: torch.device) -> dict[str, Any]:
    """A group of one rank formed as a run of several ranks forms its own
    (`baton.runtime.group.join`: NCCL where there is a GPU, gloo otherwise), an all-reduce
    on the device through it, and the group left."""
    import torch.distributed as dist

    from baton.runtime.group import join
    from shared.contracts.child import Rendezvous

    group = join(Rendezvous(epoch=1, rank=0, world_size=1, addr="127.0.0.1"), lambda _: None)
    try:
        t = torch.full((4,), 2.0, device=device)
        dist.all_reduce(t)
        sync(device)
        return {"backend": str(dist.get_backend()), "all_reduce": float(t.sum().item())}
    finally:
        group.leave()


def cost(ctx: RunContext) -> None:
    """Proof 3: Baton's checkpoints of a large model, timed from inside (`probe`). A
    checkpoint is asked for at steps 2 and 4, each once the writer is idle (so the loop's
    stall is its own, not a wait for the last write), and the final one follows the last
    step; the pinned-copy limit is measured after the first step, on the same tensors."""
    probe = Probe()
    probe.install()
    shape = shape_of(ctx.config)
    model, opt = build(shape, ctx.seed, ctx.device)
    batches = ctx.data_loader(Tokens(shape.vocab, shape.seq, shape.windows, ctx.seed),
                              batch_size=shape.batch)  # fmt: skip
    ctx.restore(model=model, optimizer=opt)
    limit, asked = 0.0, 0
    for step in ctx.steps():
        if step in (2, 4):
            while probe.written < asked:  # between steps: the loop is not timed here
                time.sleep(0.05)
            ctx.checkpoint()
            asked += 1
        loss = train_step(model, opt, next(batches), ctx.device)
        ctx.report(loss=loss.item())
        if step == 0:
            sync(ctx.device)
            limit = pinned_limit(state_tensors(model, opt))
    _write(ctx.config["out"], {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": sum(t.numel() * t.element_size() for t in state_tensors(model, opt)),
        "pinned_limit_s": limit,
        "copies": [msgspec.structs.asdict(c) for c in probe.copies],
        "saves": [msgspec.structs.asdict(s) for s in probe.saves],
        "writes": probe.writes,
    })  # fmt: skip


def rate(ctx: RunContext) -> None:
    """Proof 4, under Baton: the steps from `warm` to the last, timed (the loop's own work
    and everything Baton does between steps: reports, checkpoints)."""
    shape = shape_of(ctx.config)
    model, opt = build(shape, ctx.seed, ctx.device)
    batches = ctx.data_loader(
        Tokens(shape.vocab, shape.seq, shape.windows, ctx.seed), batch_size=shape.batch,
        num_workers=1, pin_memory=ctx.device.type == "cuda",
    )  # fmt: skip
    ctx.restore(model=model, optimizer=opt)
    warm, began, ended = int(ctx.config["warm"]), 0.0, 0.0
    for step in ctx.steps():
        if step == warm:
            sync(ctx.device)
            began = time.perf_counter()
        loss = train_step(model, opt, next(batches), ctx.device)
        ctx.report(loss=loss.item())
        if step == ctx.total_steps - 1:
            sync(ctx.device)
            ended = time.perf_counter()
    steps = ctx.total_steps - warm
    _write(ctx.config["out"], {"steps": steps, "seconds": ended - began})


def bare(config: dict[str, Any], out: str) -> None:
    """Proof 4's baseline: the same loop without Baton (a plain loader over the same data,
    reshuffled every epoch), as its own process on the same device. It runs `seconds` after
    its warm-up, and says how many steps that took, for the run under Baton to take."""
    torch.manual_seed(int(config["seed"]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape_of(config)
    model, opt = build(shape, int(config["seed"]), device)
    data = Tokens(shape.vocab, shape.seq, shape.windows, int(config["seed"]))
    g = torch.Generator().manual_seed(int(config["seed"]))
    loader = DataLoader(
        data, batch_size=shape.batch, sampler=RandomSampler(data, generator=g), num_workers=1,
        pin_memory=device.type == "cuda",
    )  # fmt: skip

    def batches() -> Any:
        while True:  # a worker per epoch, as under Baton (`baton.runtime.data.Batches`)
            yield from loader

    stream, warm = batches(), int(config["warm"])
    for _ in range(warm):
        train_step(model, opt, next(stream), device).item()
    sync(device)
    began, steps = time.perf_counter(), 0
    while time.perf_counter() - began < float(config["seconds"]) or steps < 10:
        train_step(model, opt, next(stream), device).item()
        steps += 1
    sync(device)
    _write(out, {"steps": steps, "seconds": time.perf_counter() - began, "device": str(device)})


def _children() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[1] == me:
                found.append(int(entry))
    return found


def _write(path: str, value: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "bare":
        sys.exit("usage: python -m bench.gpu.jobs bare CONFIG_JSON OUT")
    bare(json.loads(sys.argv[2]), sys.argv[3])
