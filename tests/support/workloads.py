"""Entry points for tests: the example's model with a controllable pace, and misbehaving
ones. Imported by real trainer child processes, like any user's code."""

from __future__ import annotations

import time

import torch
from torch import nn

from baton import RunContext
from examples.regression import make_batch


def paced(ctx: RunContext) -> None:
    """The example regression, sleeping `pace` seconds per step so a test can act mid-run."""
    dim, hidden, batch = (
        int(ctx.config.get(k, d)) for k, d in (("dim", 16), ("hidden", 32), ("batch", 32))
    )
    pace = float(ctx.config.get("pace", 0.02))
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
        time.sleep(pace)
