"""User-shaped entry points that go wrong the way real training does: a data pipeline that
hangs, a step that is slow but steady, a poisoned sample that blows the loss up, code that
fails once. Each trains a small model with an optimizer and a scheduler on batches drawn
from `ctx.data_loader()`, and reports its loss and gradient norm, as a user's loop does.
Imported by real trainer child processes."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from baton import RunContext

SAMPLES = 256


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed regression set; `hang_at` makes reading that sample hang (a dead mount, a
    deadlocked reader), `poison` makes that sample's target infinite (a corrupt record)."""

    def __init__(self, hang_at: int = -1, poison: int = -1) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(SAMPLES, generator=g)
        self.hang_at = hang_at
        self.poison = poison

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.hang_at:
            while True:  # a real hang in user code: the trainer must notice it alone
                time.sleep(1)
        y = torch.tensor(math.inf) if i == self.poison else self.y[i]
        return self.x[i], y


def _train(ctx: RunContext, data: Pairs, step_s: float = 0.0, fail_at: int = -1) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=float(ctx.config.get("lr", 0.05)))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
    batches = ctx.data_loader(data, batch_size=8, shuffle=bool(ctx.config.get("shuffle", True)))
    start = ctx.restore(model=model, optimizer=opt, scheduler=sched)
    for step in ctx.steps():
        if step == fail_at and start == 0:
            raise RuntimeError(f"failing once, at step {step}")
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        opt.step()
        sched.step()
        ctx.report(loss=loss.item(), grad_norm=float(norm))
        if step_s:
            time.sleep(step_s)


def hangs(ctx: RunContext) -> None:
    """Reading sample `hang_at` hangs (in order, so at a known step)."""
    config: dict[str, Any] = ctx.config
    _train(ctx, Pairs(hang_at=int(config.get("hang_at", 40))), float(config.get("step_s", 0)))


def slow(ctx: RunContext) -> None:
    """Every step takes `step_s` seconds: slow, but steady."""
    _train(ctx, Pairs(), float(ctx.config.get("step_s", 1.0)))


def poisoned(ctx: RunContext) -> None:
    """Sample `poison` has an infinite target: the loss of the step that draws it is not
    finite, and training on it would make every weight NaN."""
    _train(
        ctx, Pairs(poison=int(ctx.config.get("poison", 100))), float(ctx.config.get("step_s", 0))
    )


def fails_once(ctx: RunContext) -> None:
    """Raises at step `fail_at` of a fresh start; a resumed attempt trains on."""
    _train(
        ctx, Pairs(), float(ctx.config.get("step_s", 0)), fail_at=int(ctx.config.get("fail_at", 3))
    )
