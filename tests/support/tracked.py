"""An entry point for the trackers' end-to-end tests: the paced regression that reports
its loss to Baton (`ctx.report`, which the job's `[tracking]` carries to the tracker) and,
for TensorBoard, also logs it through its own `SummaryWriter` (`ctx.tracking`), and kills
its own training process at planned steps — once per step, across attempts (a marker file
says a kill was done) — with SIGKILL, as a machine's crash would."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from baton import RunContext
from examples.regression import make_batch


def train(ctx: RunContext) -> None:
    kills = [int(k) for k in ctx.config.get("kill_at", [])]
    marks = Path(str(ctx.config.get("marks", ".")))
    pace = float(ctx.config.get("pace", 0.0))
    never = threading.Event()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ctx.restore(model=model, optimizer=opt)
    tracking = ctx.tracking
    writer = None
    if tracking is not None and tracking.config.kind == "tensorboard":
        writer = tracking.summary_writer()
    for step in ctx.steps():
        x, y = make_batch(ctx.seed, step, 32, 16)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(loss=loss.item())
        if writer is not None:
            writer.add_scalar("user_loss", loss.item(), step)
            writer.flush()
        if step in kills and not (mark := marks / f"killed-{step}").exists():
            mark.touch()
            print(f"tracked: killing this training process at step {step}", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if pace > 0:
            never.wait(pace)
    if writer is not None:
        writer.close()
