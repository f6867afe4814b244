"""The Hugging Face `Trainer` (and `Seq2SeqTrainer`, any subclass) under Baton.

An existing script changes in two places: its `TrainingArguments` come from
`training_arguments(ctx, ...)`, and `trainer.train()` becomes `fit(ctx, trainer)`:

    from baton.integrations import hf

    def train(ctx: RunContext) -> None:
        model = AutoModelForCausalLM.from_config(config)
        args = hf.training_arguments(ctx, per_device_train_batch_size=8, learning_rate=3e-3)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
        hf.fit(ctx, trainer)

What each part does, and why:

* `training_arguments` sets what Baton owns — `max_steps` (the job's `total_steps`), the
  seeds (the job's), a local `output_dir` per rank — and defaults that keep a run quiet and
  bounded: no progress bar — the Trainer's, nor transformers'
  "Loading weights" and "Writing model shards" (the output is the run's log) — a log
  line every 10 steps (`logging_steps`), two local checkpoints at most. `report_to` is
  the user's (the Trainer's default: none); with the job's `[tracking]`, the Trainer's own
  tracker callbacks resume the run's one tracker run (`_tracked`; docs/tracking.md), and
  its logs reach the tracker through Baton, each kept step once. The save cadence
  is the job's `[checkpoint]` policy; a `save_steps`/`save_strategy` given here adds the
  Trainer's own, and every save is a commit.
* `fit` adds `BatonCallback` and resumes: the newest committed checkpoint's files are
  downloaded and handed to `Trainer.train(resume_from_checkpoint=...)`, so the Trainer loads
  its model, optimizer, scheduler, RNG states and trainer state itself and skips the
  batches of the epoch already trained on (its own `ignore_data_skip` semantics).
* `BatonCallback` is the step boundary (`baton.runtime.external`): at each step's end it
  asks Baton whether to save or stop (`control.should_save`, `should_training_stop`); the
  Trainer's `on_save` hands its `checkpoint-<step>` directory to Baton, which stores and
  commits it under the attempt's fencing token; its logs (loss, learning rate, gradient
  norm) become the run's metrics. It has the Trainer log every step (printing only every
  `logging_steps`): the self-check compares each step's loss after a resume, and the
  Trainer's logged loss is a mean since its last log, which would differ between an
  attempt that resumed and one that did not if logs were sparser. So a printed loss is its
  step's, not a mean over the steps since the line before.

Exactness: with `deterministic = true` and the same data order, a resumed run ends on the
same bits as one that never stopped (tests/baton/integrations/test_hf.py). A run of several
ranks is Accelerate's (`baton.integrations.accelerate`); the Trainer here runs `ranks = 1`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from transformers import (
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from baton.runtime.context import RunContext
from baton.runtime.external import ExternalLoop, local_dir

Args = TypeVar("Args", bound=TrainingArguments)

_OWNED = ("max_steps", "num_train_epochs", "seed", "data_seed")
"""Arguments Baton sets from the job: one run, one length, one seed."""


def training_arguments(
    ctx: RunContext, cls: type[Args] = TrainingArguments, **kwargs: Any  # type: ignore[assignment]
) -> Args:
    """`cls(**kwargs)` (`TrainingArguments`, `Seq2SeqTrainingArguments`, …) with what Baton
    needs: the job's length and seed, a local output directory, a log line every step."""
    if ctx.world_size > 1:
        raise ValueError(
            "the Trainer runs one rank under Baton (ranks = 1); for several, write the loop"
            " with Accelerate (baton.integrations.accelerate)"
        )
    if taken := sorted(set(kwargs) & set(_OWNED)):
        raise ValueError(
            f"{', '.join(taken)} come(s) from the job (total_steps, seed): leave them out"
        )
    quiet()
    defaults: dict[str, Any] = {
        "output_dir": str(local_dir(ctx, "hf")),
        "save_strategy": "no",  # the job's policy asks through the callback
        "save_total_limit": 2,
        "disable_tqdm": True,
        "logging_steps": 10,
    }
    return cls(
        **{**defaults, **kwargs}, max_steps=ctx.total_steps, seed=ctx.seed, data_seed=ctx.seed
    )


def quiet() -> None:
    """No progress bar of transformers' or the Hub's in this process (loading a checkpoint's
    weights, writing its shards): in a run's log each redraw is a line of noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def fit(ctx: RunContext, trainer: Trainer) -> None:
    """`trainer.train()` under Baton: from the newest committed checkpoint, if any, to the
    job's last step or until the run is told to stop (a checkpoint first)."""
    if trainer.args.max_steps != ctx.total_steps:
        raise ValueError(
            f"the Trainer's max_steps is {trainer.args.max_steps}, the job's total_steps"
            f" {ctx.total_steps}: build its arguments with training_arguments(ctx, ...)"
        )
    quiet()
    loop = ExternalLoop(ctx)
    trainer.add_callback(BatonCallback(loop))
    if trainer.pop_callback(PrinterCallback) is not None:
        trainer.add_callback(_Printer())
    resume = loop.resume()
    _tracked(ctx, trainer)
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)


def _tracked(ctx: RunContext, trainer: Trainer) -> None:
    """The Trainer's own tracker callbacks (`report_to`) in a run with `[tracking]`; each
    resumes the run's one tracker run (docs/tracking.md):

    * TensorBoard (`[tracking]` TensorBoard): its callback writes to the run's log dir
      through a writer opened with `purge_step` (`ctx.tracking.summary_writer`), so the
      steps an attempt redoes replace what a killed one logged.
    * MLflow (`[tracking]` MLflow): its callback starts the run `MLFLOW_RUN_ID` names and
      logs the arguments and the model's config as always; its logs reach the run through
      Baton, under the same names and steps, once per kept step, and not a second time
      through the callback (which would log each redone step again).
    * W&B (`[tracking]` W&B): its callback finds the run Baton opened (the one
      `WANDB_RUN_ID` names) and logs the arguments and the model's config to it as always;
      its logs reach the run through Baton, once per kept step, and not a second time
      through the callback (which numbers its rows by W&B's own counter, so each redone
      step would be a row again)."""
    from transformers.integrations.integration_utils import (
        MLflowCallback,
        TensorBoardCallback,
        WandbCallback,
    )

    tracking = ctx.tracking
    if tracking is None:
        return
    if tracking.config.kind == "tensorboard" and trainer.pop_callback(TensorBoardCallback):
        writer = tracking.summary_writer(first_step=1)  # the Trainer's steps count from 1
        trainer.add_callback(TensorBoardCallback(tb_writer=writer))  # type: ignore[no-untyped-call]
    if tracking.config.kind == "mlflow" and trainer.pop_callback(MLflowCallback):
        trainer.add_callback(_mlflow_once()())
    if tracking.config.kind == "wandb" and trainer.pop_callback(WandbCallback):
        trainer.add_callback(_wandb_once()())


def _mlflow_once() -> type[TrainerCallback]:
    from transformers.integrations.integration_utils import MLflowCallback

    class MlflowOnce(MLflowCallback):
        """The Trainer's MLflow callback, its metrics left to Baton's rows."""

        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            logs: Any = None,
            model: Any = None,
            **kwargs: Any,
        ) -> None:
            if not self._initialized:
                self.setup(args, state, model)  # type: ignore[no-untyped-call]

    return MlflowOnce


def _wandb_once() -> type[TrainerCallback]:
    from transformers.integrations.integration_utils import WandbCallback

    class WandbOnce(WandbCallback):
        """The Trainer's W&B callback, its metrics left to Baton's rows."""

        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            model: Any = None,
            logs: Any = None,
            **kwargs: Any,
        ) -> None:
            if not self._initialized:
                self.setup(args, state, model)  # type: ignore[no-untyped-call]

    return WandbOnce


class BatonCallback(TrainerCallback):
    """The Trainer's side of Baton's step boundary (see the module's docstring)."""

    def __init__(self, loop: ExternalLoop) -> None:
        self.loop = loop

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        at = self.loop.step_ended(state.global_step)
        control.should_log = True
        if at.save:
            control.should_save = True
        if at.stop:
            control.should_training_stop = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        metrics = {
            k: float(v)
            for k, v in (logs or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if metrics:
            self.loop.reported(state.global_step, **metrics)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        **_: Any,
    ) -> None:
        step = state.global_step
        directory = Path(str(args.output_dir)) / f"checkpoint-{step}"
        self.loop.saved(step, directory, weights=model.state_dict())


class _Printer(PrinterCallback):
    """The Trainer's log lines at the cadence the user asked for (`logging_steps`), though
    Baton has it log every step; and the summary at the end."""

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        every = max(1, int(state.logging_steps or 1))
        if logs and state.is_local_process_zero and (
            state.global_step % every == 0 or "train_runtime" in logs
        ):  # as the Trainer's own printer shows them
            shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in logs.items()}
            shown.pop("total_flos", None)
            print(shown, flush=True)
