"""Entry points for tests: the example's model with a controllable pace, and misbehaving
ones. Imported by real trainer child processes, like any user's code."""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

from baton import RunContext
from examples.regression import make_batch


def paced(ctx: RunContext) -> None:
    """The example regression, waiting `pace` seconds per step so a test can act mid-run.
    A timed `Event.wait`, not `time.sleep`: under libfaketime with the monotonic clock left
    true (a host whose wall clock is off, tests/e2e/test_skew.py), 0.9.10 fails Python's
    `time.sleep` (an absolute `clock_nanosleep`) with EINVAL."""
    dim, hidden, batch = (
        int(ctx.config.get(k, d)) for k, d in (("dim", 16), ("hidden", 32), ("batch", 32))
    )
    pace = float(ctx.config.get("pace", 0.02))
    never = threading.Event()
    model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ctx.restore(model=model, optimizer=opt)
    for step in ctx.steps():
        x, y = make_batch(ctx.seed, step, batch, dim)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
        if pace > 0:
            never.wait(pace)


def stall(ctx: RunContext) -> None:
    """Trains a few steps, then hangs inside a step, as a deadlocked data loader would."""
    model = nn.Linear(4, 1)
    ctx.restore(model=model)
    for step in ctx.steps():
        if step >= int(ctx.config.get("stall_at", 5)):
            while True:
                time.sleep(1)
        time.sleep(0.01)


def boom(ctx: RunContext) -> None:
    """Raises partway through, as buggy user code does."""
    model = nn.Linear(4, 1)
    ctx.restore(model=model)
    for step in ctx.steps():
        if step == int(ctx.config.get("boom_at", 3)):
            raise RuntimeError(f"boom at step {step}")
        time.sleep(0.01)


def kill_trainer(ctx: RunContext) -> None:
    """Takes its trainer down with it, every time: a task that can never succeed."""
    import os
    import signal

    model = nn.Linear(4, 1)
    ctx.restore(model=model)
    for step in ctx.steps():
        if step == 2:
            os.kill(_trainer_pid(), signal.SIGKILL)
        time.sleep(0.01)


def _trainer_pid() -> int:
    """The trainer above this training process (its parent is the trainer's zygote)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"services.trainer" in argv:
            return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no trainer above this process")


def chatty(ctx: RunContext) -> None:
    """Prints as it trains, so its captured output can be checked."""
    model = nn.Linear(4, 1)
    ctx.restore(model=model)
    for step in ctx.steps():
        if step % 10 == 0:
            print(f"chatty: at step {step}", flush=True)
        time.sleep(float(ctx.config.get("pace", 0.01)))


def unregistered_generator(ctx: RunContext) -> None:
    """The example regression with its dropout masks drawn from a generator it never
    registers: a resumed attempt restarts it from the seed, so its masks differ from the
    uninterrupted run's. Deterministic in every other way — the self-check must flag it."""
    dim, hidden, batch = 16, 32, 32
    pace = float(ctx.config.get("pace", 0.02))
    g = torch.Generator().manual_seed(ctx.seed)
    first, second = nn.Linear(dim, hidden), nn.Linear(hidden, 1)
    model = nn.Sequential(first, second)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ctx.restore(model=model, optimizer=opt)
    for step in ctx.steps():
        x, y = make_batch(ctx.seed, step, batch, dim)
        h = torch.relu(first(x))
        keep = (torch.rand(h.shape, generator=g) > 0.1).float() / 0.9
        loss = nn.functional.mse_loss(second(h * keep), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
        time.sleep(pace)


def elastic_probe(ctx: RunContext) -> None:
    """`examples/elastic.py`'s model and loop, which also writes what it restored, and what
    it holds when it stops early, to `<dump>/<token>-<restored|stopped>-rank<k>.safetensors`
    (weights, and every optimizer and scheduler value): a test compares them bit for bit."""
    from safetensors.torch import save_file

    from examples.elastic import Blobs

    cfg = ctx.config
    torch.manual_seed(ctx.seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    dp = ctx.data_parallel(model, Blobs(ctx.seed, 512, 8, 4), batch_size=8, shards=cfg["shards"])

    def dump(what: str) -> None:
        state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
        for i, s in opt.state_dict()["state"].items():
            state.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
        state["sched.last_epoch"] = torch.tensor(sched.last_epoch)
        save_file(state, f"{cfg['dump']}/{ctx.token}-{what}-rank{ctx.rank}.safetensors")

    ctx.restore(model=model, optimizer=opt, scheduler=sched)
    dump("restored")
    for step in ctx.steps():
        for shard in dp.shards(step):
            x, y = shard.batch
            shard.backward(nn.functional.cross_entropy(model(x), y))
        loss = dp.sync()
        opt.step()
        sched.step()
        ctx.report(loss=loss)
        time.sleep(float(cfg.get("pace", 0.0)))
    if ctx.finished_early:
        dump("stopped")


class _Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`size` (x, y) pairs of a fixed random linear map with noise; pair i is a pure function
    of (seed, i), so a resumed run's loader hands out the same samples."""

    def __init__(self, size: int, dim: int, seed: int) -> None:
        self.size, self.dim, self.seed = size, dim, seed
        self.w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)) / dim**0.5

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(self.dim, generator=g)
        return x, torch.tanh(self.w @ x) + 0.05 * torch.randn(self.dim, generator=g)


def wide(ctx: RunContext) -> None:
    """A user-shaped job whose checkpoints weigh a few MB: a wide MLP (`dim → width → dim`,
    4 × dim × width bytes of weights, as many again of SGD momentum), fed by
    `ctx.data_loader` over a map-style dataset, with dropout; sleeps `pace` s per step."""
    cfg = ctx.config
    dim, width = int(cfg.get("dim", 32)), int(cfg.get("width", 4096))
    model = nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, dim))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    batches = ctx.data_loader(
        _Pairs(int(cfg.get("samples", 512)), dim, ctx.seed),
        batch_size=int(cfg.get("batch", 16)),
        num_workers=int(cfg.get("num_workers", 0)),
        drop_last=True,
    )
    ctx.restore(model=model, optimizer=opt)
    for _step in ctx.steps():
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
        time.sleep(float(cfg.get("pace", 0.0)))


def fsdp_probe(ctx: RunContext) -> None:
    """`examples/fsdp_lm.py`'s model and loop (FSDP2), which also writes the whole of what it
    restored, and of what it holds when it stops early, gathered from every rank, to
    `<dump>/<token>-<restored|stopped>.safetensors` (every parameter, every AdamW value, the
    schedule's step): a test compares them bit for bit across group sizes."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from examples.fsdp_lm import setup, train_step

    cfg = ctx.config
    run = setup(ctx)

    def whole(t: torch.Tensor) -> torch.Tensor:
        full = getattr(t, "full_tensor", None)  # a DTensor's whole, gathered from every rank
        return (full() if full is not None else t).detach().clone()

    def dump(what: str) -> None:
        state = {f"model.{k}": whole(v) for k, v in get_model_state_dict(run.model).items()}
        for p, values in get_optimizer_state_dict(run.model, run.opt)["state"].items():
            state.update({f"opt.{p}.{k}": whole(v) for k, v in values.items()})
        state["sched.last_epoch"] = torch.tensor(run.sched.last_epoch)
        if ctx.rank == 0:
            save_file(state, f"{cfg['dump']}/{ctx.token}-{what}.safetensors")

    ctx.restore(model=run.model, optimizer=run.opt, scheduler=run.sched)
    dump("restored")
    for step in ctx.steps():
        ctx.report(loss=train_step(run, ctx, step))
        time.sleep(float(cfg.get("pace", 0.0)))
    if ctx.finished_early:
        dump("stopped")


def fsdp_memory(ctx: RunContext) -> None:
    """`examples/fsdp_lm.py` (FSDP2), measuring this process's peak resident memory over
    `restore()` and over one checkpoint taken at step `config.save_at` and written through,
    each above what it held just before, against the bytes of its own shard of the model and
    AdamW's state and of the whole of them. Writes `<dump>/memory-<token>-rank<k>.json`."""
    import json
    import re

    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from examples.fsdp_lm import setup, train_step

    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            found = re.search(rf"{field}:\s+(\d+) kB", f.read())
        assert found is not None
        return int(found.group(1)) * 1024

    def measured(what: object) -> tuple[int, int]:
        """Peak resident bytes while `what` (a callable) runs, above those resident before
        it and above those resident after it."""
        before = kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from what is resident now
        what()  # type: ignore[operator]
        peak = kib("VmHWM")
        return peak - before, peak - kib("VmRSS")

    run = setup(ctx)
    out: dict[str, int] = {}
    out["load"], out["load_transient"] = measured(
        lambda: ctx.restore(model=run.model, optimizer=run.opt, scheduler=run.sched)
    )
    for step in ctx.steps():
        if step == int(ctx.config["save_at"]):  # `step` steps done: a checkpoint of them

            def save() -> None:
                ctx.checkpoint()
                ctx._checkpoints.wait()  # the write, through, inside the measure

            out["save"], out["save_transient"] = measured(save)
        ctx.report(loss=train_step(run, ctx, step))
    state = list(get_model_state_dict(run.model).values())
    for values in get_optimizer_state_dict(run.model, run.opt)["state"].values():
        state += list(values.values())
    local = [getattr(t, "to_local", lambda t=t: t)() for t in state]
    out["shard"] = sum(t.numel() * t.element_size() for t in local)
    out["whole"] = sum(t.numel() * t.element_size() for t in state)
    with open(f"{ctx.config['dump']}/memory-{ctx.token}-rank{ctx.rank}.json", "w") as f:
        json.dump(out, f)
