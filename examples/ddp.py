"""A data-parallel job: the same small network trained on every rank, in
`DistributedDataParallel` when the run has several ranks (`ranks` in the job).

Written the way a user writes DDP code, against the public `RunContext` API only: the model
is built the same on every rank (from the job's seed) and wrapped in DDP, which averages the
gradients; each rank draws its own share of every epoch from `ctx.data_loader()`; AdamW with
a cosine schedule; dropout, which draws from the global RNG — seeded differently on each
rank, so each rank's RNG state is its own and a resume must give each rank back its own.

The reported `loss` is the mean over the ranks (one all-reduce of the loss), so every rank
reports the run's loss, and rank 0 — whose reports are the run's — reports what the whole
group learned rather than its own share of the batch.

Config (all optional): `dim`, `hidden`, `batch` (per rank), `samples` (the dataset's size),
`lr`, `dropout`; `steps_sleep`, seconds to sleep after each step (so a test can act
mid-run); `fail_rank` and `fail_at`, to make that rank's code raise a `ValueError` at that
step, on every attempt (a user's bug); `hang_rank` and `hang_at`, to make that rank's code
hang at that step, on every attempt (a deadlocked loader), while its peers wait for it in
their next collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from baton import RunContext


class Teacher(Dataset[tuple[Tensor, Tensor]]):
    """`samples` fixed inputs and what a fixed random network makes of them."""

    def __init__(self, seed: int, samples: int, dim: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, dim, generator=g)
        w = torch.randn(dim, 1, generator=g) / dim**0.5
        self.y = torch.tanh(self.x @ w) + 0.01 * torch.randn(samples, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def train(ctx: RunContext) -> None:
    cfg: dict[str, Any] = ctx.config
    dim, hidden = int(cfg.get("dim", 8)), int(cfg.get("hidden", 32))
    pause = float(cfg.get("steps_sleep", 0))
    fail_rank, fail_at = int(cfg.get("fail_rank", -1)), int(cfg.get("fail_at", -1))
    hang_rank, hang_at = int(cfg.get("hang_rank", -1)), int(cfg.get("hang_at", -1))

    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    model = nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(float(cfg.get("dropout", 0.1))),
        nn.Linear(hidden, 1),
    ).to(ctx.device)
    net: nn.Module = model
    if ctx.world_size > 1:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 3e-3)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    data = ctx.data_loader(
        Teacher(ctx.seed, int(cfg.get("samples", 512)), dim), batch_size=int(cfg.get("batch", 16))
    )
    torch.manual_seed(ctx.seed + 1 + ctx.rank)  # each rank's own dropout masks
    ctx.restore(model=model, optimizer=opt, scheduler=sched)

    for step in ctx.steps():
        if ctx.rank == fail_rank and step == fail_at:
            raise ValueError(f"rank {ctx.rank} fails at step {step}, as configured")
        while ctx.rank == hang_rank and step == hang_at:
            time.sleep(1)
        x, y = next(data)
        loss = nn.functional.mse_loss(net(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        mean = loss.detach()
        if ctx.world_size > 1:
            mean = mean.clone()
            dist.all_reduce(mean)
            mean /= ctx.world_size
        ctx.report(loss=mean.item())
        if pause:
            time.sleep(pause)
