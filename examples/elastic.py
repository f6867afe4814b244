"""An elastic data-parallel job: the same small classifier trained on however many ranks the
run holds at the moment — 1 or 2 here (`ranks = { min = 1, max = 2 }` in the job) — with
final weights that are the same bits whatever that number was and however it changed.

Written against the public `RunContext` API only. `ctx.data_parallel()` does what DDP does
in `examples/ddp.py`, exactly (`baton.runtime.exact`): every step's global batch is a fixed
number of virtual shards (by default the job's largest number of ranks) of `batch` samples;
each rank computes the gradient of the shards it owns, and they are summed in shard order
on every rank. Dropout needs no per-rank seeding: while a shard's code runs, the global RNG
is seeded for that shard. The data position comes from the step, so the loop draws nothing
before `ctx.steps()` hands the step out, and there is no data loader to register.

The reported `loss` is the mean over the whole global batch, the same on every rank.

Config (all optional): `dim`, `classes`, `hidden`, `batch` (per shard), `shards`, `samples`
(the dataset's size), `lr`, `dropout`; `steps_sleep`, seconds to sleep after each step (so
a test can act mid-run).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from baton import RunContext


class Blobs(Dataset[tuple[Tensor, Tensor]]):
    """`samples` points scattered around `classes` centres, all drawn from the seed."""

    def __init__(self, seed: int, samples: int, dim: int, classes: int) -> None:
        g = torch.Generator().manual_seed(seed)
        centres = 2 * torch.randn(classes, dim, generator=g)
        self.y = torch.randint(classes, (samples,), generator=g)
        self.x = centres[self.y] + torch.randn(samples, dim, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def train(ctx: RunContext) -> None:
    cfg: dict[str, Any] = ctx.config
    dim, classes = int(cfg.get("dim", 8)), int(cfg.get("classes", 4))
    pause = float(cfg.get("steps_sleep", 0))

    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(dim, int(cfg.get("hidden", 64))),
        nn.ReLU(),
        nn.Dropout(float(cfg.get("dropout", 0.1))),
        nn.Linear(int(cfg.get("hidden", 64)), classes),
    ).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 3e-3)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    dp = ctx.data_parallel(
        model,
        Blobs(ctx.seed, int(cfg.get("samples", 2048)), dim, classes),
        batch_size=int(cfg.get("batch", 16)),
        shards=int(cfg["shards"]) if "shards" in cfg else None,
    )
    ctx.restore(model=model, optimizer=opt, scheduler=sched)

    for step in ctx.steps():
        for shard in dp.shards(step):  # this rank's shards of the step
            x, y = shard.batch
            shard.backward(nn.functional.cross_entropy(model(x), y))
        loss = dp.sync()  # every shard's gradient, summed in shard order, on every rank
        opt.step()
        sched.step()
        ctx.report(loss=loss)
        if pause:
            time.sleep(pause)
