"""A small, real training job: an MLP learns a fixed random "teacher" network.

Batches are generated from (seed, step) alone, so the data cursor is the step itself and a
resumed run sees exactly the batches an uninterrupted one would. Written only against the
public `RunContext` API, as any user's entry point would be.
"""

from __future__ import annotations

import torch
from torch import nn

from baton import RunContext


def make_batch(seed: int, step: int, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    teacher = torch.Generator().manual_seed(seed)
    w1 = torch.randn(dim, 32, generator=teacher) / dim**0.5
    w2 = torch.randn(32, 1, generator=teacher) / 32**0.5
    x = torch.randn(batch, dim, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(batch, 1, generator=g)
    return x, y


def train(ctx: RunContext) -> None:
    dim = int(ctx.config.get("dim", 16))
    hidden = int(ctx.config.get("hidden", 64))
    batch = int(ctx.config.get("batch", 64))
    model = nn.Sequential(
        nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.05), nn.Linear(hidden, 1)
    ).to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=float(ctx.config.get("lr", 3e-3)))
    ctx.restore(model=model, optimizer=opt)
    for step in ctx.steps():
        x, y = make_batch(ctx.seed, step, batch, dim)
        loss = nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
