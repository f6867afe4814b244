"""Entry points for the trackers' end-to-end tests: the Hugging Face and Lightning examples
unchanged, their training process SIGKILLed — as a machine's crash would — at the end of
planned global steps (`kill_at`, in the job's config), once per step across attempts (a
marker file in `marks` says a kill was done). The kill is added as one more callback of
the framework's trainer, so the example's code and the user's are what runs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from baton import RunContext


def _kill_if_due(ctx: RunContext, global_step: int) -> None:
    kills = [int(k) for k in ctx.config.get("kill_at", [])]
    marks = Path(str(ctx.config.get("marks", ".")))
    if global_step in kills and not (mark := marks / f"killed-{global_step}").exists():
        mark.touch()
        print(f"killing: this training process at global step {global_step}", file=sys.stderr)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def hf(ctx: RunContext) -> None:
    """`examples.hf_lm:train`, killed at the end of each of the Trainer's global steps in
    `kill_at` (1 for the first step)."""
    from transformers import TrainerCallback

    from baton.integrations import hf as integration
    from examples import hf_lm

    class Kill(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _kill_if_due(ctx, state.global_step)

    fit = integration.fit

    def fit_killed(ctx: RunContext, trainer: Any) -> None:
        trainer.add_callback(Kill())
        fit(ctx, trainer)

    integration.fit = fit_killed
    hf_lm.train(ctx)


def lightning(ctx: RunContext) -> None:
    """`examples.lightning_lm:train`, killed at the end of each of Lightning's global steps
    in `kill_at` (1 for the first step)."""
    import lightning as L

    from baton.integrations.lightning import BatonCallback
    from examples import lightning_lm

    class Kill(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
            _kill_if_due(ctx, trainer.global_step)

    kwargs_of = BatonCallback.trainer_kwargs

    def trainer_kwargs(self: BatonCallback, **kwargs: Any) -> dict[str, Any]:
        out = kwargs_of(self, **kwargs)
        out["callbacks"] = [Kill(), *out["callbacks"]]
        return out

    BatonCallback.trainer_kwargs = trainer_kwargs  # type: ignore[method-assign]
    lightning_lm.train(ctx)
