"""An entry point for training processes whose wall clock libfaketime skews (test_skew.py).

The example regression of `tests.support.workloads.paced`, paced by `Event.wait` instead of
`time.sleep`: on Python 3.11+ `time.sleep` is `clock_nanosleep` with an absolute deadline
on the monotonic clock, which libfaketime 0.9.10 rejects with EINVAL when it leaves the
monotonic clock alone (`FAKETIME_DONT_FAKE_MONOTONIC=1`); and faking the monotonic clock
instead makes every timed wait on a lock or condition hang. A timed `Event.wait` is right
in the first setting, the one a host whose wall clock is off really has.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from baton import RunContext
from examples.regression import make_batch


def paced(ctx: RunContext) -> None:
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
