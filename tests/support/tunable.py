"""An entry point for rollback and fork tests: the example regression, deterministic, whose
learning rate a fork may change, which says what it restored and can be held at a step.
Imported by real trainer child processes, like any user's code."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
from torch import nn

from baton import RunContext
from examples.regression import make_batch
from shared.checkpoint.digest import weights_digest


def gated(ctx: RunContext) -> None:
    """Trains as `examples.regression` does, with `lr` from the config — set again after the
    restore, since an optimizer's saved state carries the rate it was saved with. Prints the
    digest of the weights it restored (`restored step N digest D`), and waits before step
    `gate_at` until the file `gate` exists, so a test acts while the run is at a known step;
    fails (its own code's failure) at step `fail_at` unless the file `mend` exists — or,
    with `by = "sigbus"`, dies of a SIGBUS there once (a hardware fault); `pace`
    seconds after each step. A timed `Event.wait`, never `time.sleep` (see
    `tests.support.workloads.paced`)."""
    dim, hidden, batch = (
        int(ctx.config.get(k, d)) for k, d in (("dim", 16), ("hidden", 32), ("batch", 32))
    )
    lr = float(ctx.config.get("lr", 3e-3))
    model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    start = ctx.restore(model=model, optimizer=opt)
    for group in opt.param_groups:
        group["lr"] = lr
    # As Baton digests a checkpoint: the first registered object's tensors, under its name.
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    print(f"restored step {start} digest {weights_digest(weights)}", flush=True)
    gate, gate_at = Path(str(ctx.config.get("gate", "-"))), int(ctx.config.get("gate_at", -1))
    pace = float(ctx.config.get("pace", 0.0))
    fail_at, mend = int(ctx.config.get("fail_at", -1)), Path(str(ctx.config.get("mend", "-")))
    never = threading.Event()
    for step in ctx.steps():
        while step == gate_at and not gate.exists():
            never.wait(0.05)
        if step == fail_at and not mend.exists():
            if ctx.config.get("by") == "sigbus":  # as a machine whose memory failed: once
                mend.touch()
                os.kill(os.getpid(), signal.SIGBUS)
            raise RuntimeError(f"failing at step {step}, as asked")
        x, y = make_batch(ctx.seed, step, batch, dim)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        ctx.report(loss=loss.item())
        if pace > 0:
            never.wait(pace)
