"""Lightning under Baton: an existing `LightningModule` + `LightningDataModule` +
`Trainer.fit` script, made resumable with three lines.

    from baton.integrations.lightning import BatonCallback

    def train(ctx: RunContext) -> None:
        baton = BatonCallback(ctx)                                       # 1
        model, data = MyModule(...), MyData(...)
        trainer = L.Trainer(**baton.trainer_kwargs(gradient_clip_val=1.0))  # 2
        trainer.fit(model, datamodule=data, ckpt_path=baton.ckpt_path())    # 3

Built on `baton.runtime.external` (a loop Baton does not own). Lightning keeps its loop,
its checkpoint format and its restore logic; Baton decides *when* a checkpoint is taken and
stores it as a fenced, verified commit.

**Saving.** `on_train_batch_end` runs on every rank after every optimizer step, with
`trainer.global_step` the steps done: there the callback asks Baton's step boundary
(`ExternalLoop.step_ended`, one all-reduce in a group) whether to save and whether to stop.
A save is Lightning's own `trainer.save_checkpoint` into a fresh directory, handed to
`ExternalLoop.saved`, then deleted (Baton has linked the file aside). A stop sets
`trainer.should_stop` after that save, so `fit` returns at the step it saved. The .ckpt is
Lightning's: model, optimizers, LR schedulers, loop progress, the state of a stateful data
loader (torchdata's `StatefulDataLoader`: Lightning saves and restores it through its
`CombinedLoader`), callbacks' states, the datamodule's `state_dict`.

**Resuming.** `ckpt_path()` downloads the newest committed checkpoint (`ExternalLoop.resume`)
and names its .ckpt for `Trainer.fit(ckpt_path=...)`; Lightning restores everything above
and continues mid-epoch at the batch after the saved step.

**The global RNGs.** Lightning's checkpoint does not hold them, and Lightning draws from
them between training steps as it pleases: every `iter()` of a data loader without a
`generator=` draws a base seed (a new epoch, every validation run), a sanity check runs at
every `fit`, validation runs where it falls. So the callback fences them: it captures the
torch/CUDA/numpy/Python RNG states once a step ends (its own `state_dict`, so in the .ckpt
too) and puts them back when the next training batch starts (`on_train_batch_start`). What
a training step draws therefore continues exactly from the step before it, in an
uninterrupted run and in a resumed one alike; what runs between two steps (validation, a
new epoch's iterator, the sanity check of a resumed `fit`) draws from the same states and
is then forgotten. The price is that a Baton run's random stream differs from the same
script run by plain Lightning wherever something drew between steps.

**Metrics.** What the module logs with `self.log(...)` during a training step becomes the
step's Baton metrics (the `Progress` events, the run's record, the resume self-check):
only values logged during that very step, never ones left over in
`trainer.callback_metrics` from an earlier step or epoch. Values logged in validation are
reported for the step validation ran at (`ExternalLoop.reported`). Epoch aggregates of
training metrics (`on_epoch=True`) are not reported: Lightning does not checkpoint its
metric accumulators, so after a mid-epoch resume they cover only the batches since it.

**Several ranks.** Baton has initialised the default process group before the entry point
runs. `trainer_kwargs()` gives Lightning's DDP a `ClusterEnvironment` that reports Baton's
ranks (`BatonEnvironment`: processes created externally, each rank a node of one device)
and a DDP strategy (`BatonDDPStrategy`) that launches nothing (Lightning's launcher would
also reset the number of torch threads) and finds the group initialised (Lightning's
`_init_dist_connection` then returns at once). Lightning writes a checkpoint on rank 0
only; a rank's own state (its data position, its RNGs, its callbacks' states) is in that
rank's own `lightning.rank<k>.ckpt`, which every other rank of `BatonDDPStrategy` writes
at Baton's saves: the .ckpt minus the model and optimizer states, which are the same on
every rank. On resume each rank loads rank 0's .ckpt with its own file laid over it. The
training loader's order is made resumable (`lightning_ddp.resumable`): a
`StatefulDataLoader(shuffle=True)` is dealt by a `DistributedSampler` shuffling by (seed,
epoch), as Lightning deals a shuffled torch `DataLoader`, and its epoch is set before
Lightning first iterates it.

**An epoch's last step.** Lightning resumes a checkpoint saved there one epoch ahead (it
counts an empty epoch): `on_load_checkpoint` and `on_train_start` make the run go on with
the next epoch as the uninterrupted run did.

All of this was checked against Lightning 2.6, torchdata 0.11 and torch 2.13 (CPU), which
is where it reads Lightning's loop state and torchdata's loader state (the names say so):
tests/baton/integrations/test_lightning.py resumes across epoch ends, validation, SIGKILL,
SIGTERM and a lost rank, bit for bit.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer

from baton.integrations.lightning_ddp import (
    CKPT,
    BatonDDPStrategy,
    BatonEnvironment,
    ends_epoch,
    every_rank,
)
from baton.runtime.context import RunContext
from baton.runtime.external import ExternalLoop
from baton.runtime.load import rng_state, set_rng_state
from shared.checkpoint.files import rank_prefix

__all__ = ["CKPT", "BatonCallback", "BatonDDPStrategy", "BatonEnvironment"]


class BatonCallback(Callback):
    """Baton's step boundary in Lightning's loop: saves and stops when the run says, resumes
    from the run's newest commit, fences the global RNGs, reports what the module logs."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.loop = ExternalLoop(ctx)
        self._ckpt: str | None = None
        self._resumed = False
        self._rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        """The global RNG states as the last training step left them (the fence)."""
        self._before: dict[str, torch.Tensor] = {}
        """`callback_metrics` as they were before the step (or validation) began."""
        self._saves = ctx._spool / f"{rank_prefix(ctx.rank)}lightning"
        self._resumed_at_epoch_end = False

    # -- what the script calls -----------------------------------------------------------

    def ckpt_path(self) -> str | None:
        """The .ckpt of the run's newest committed checkpoint, for `Trainer.fit(ckpt_path=)`;
        None on a fresh run. Downloads it (once)."""
        if not self._resumed:
            self._resumed = True
            directory = self.loop.resume()
            if directory is not None:
                ckpt = directory / CKPT
                if not ckpt.is_file():
                    raise FileNotFoundError(
                        f"checkpoint {self.ctx.step} holds no {CKPT}: it was not written by"
                        " baton.integrations.lightning"
                    )
                self._ckpt = str(ckpt)
        return self._ckpt

    def trainer_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """`L.Trainer(**baton.trainer_kwargs(...))`: your keyword arguments with what a Baton
        run needs: `max_steps` (the job's `total_steps`), this callback, the device and, for
        several ranks, DDP on Baton's group; `deterministic=True` for a deterministic job;
        no checkpointing or progress bar of Lightning's own unless you ask for them, and
        its `default_root_dir` in the run's spool unless you give one."""
        ctx = self.ctx
        if kwargs.get("max_steps", ctx.total_steps) != ctx.total_steps:
            raise ValueError(
                f"max_steps={kwargs['max_steps']}: a Baton run trains the job's total_steps"
                f" ({ctx.total_steps}); leave max_steps out"
            )
        if kwargs.get("max_epochs", -1) not in (-1, None) or kwargs.get("max_time") is not None:
            raise ValueError(
                "max_epochs and max_time would end training before the job's total_steps:"
                " leave them out"
            )
        out: dict[str, Any] = {
            "max_steps": ctx.total_steps,
            "enable_checkpointing": False,  # Baton checkpoints
            "enable_progress_bar": False,  # the run's log is a file, not a terminal
            # Lightning's own files (a default logger's) in the run's spool, not in
            # whatever directory the trainer runs in.
            "default_root_dir": str(ctx._spool / f"{rank_prefix(ctx.rank)}lightning-root"),
        }
        if ctx.spec.deterministic:
            # Not `False` otherwise: Lightning would turn off what the trainer turned on.
            out["deterministic"] = True
        out |= self._placement(kwargs)
        callbacks = kwargs.pop("callbacks", None) or []
        if isinstance(callbacks, Callback):
            callbacks = [callbacks]
        out.update(kwargs)
        out["callbacks"] = [*callbacks, self]
        if out.get("logger", True) is True and (logger := self.logger()) is not None:
            out["logger"] = logger  # Lightning's default logger, on the run's tracker run
        return out

    def _placement(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The device and, on several ranks, DDP on Baton's group (`strategy` taken out of
        `kwargs`: a `BatonDDPStrategy` of the user's is given the group)."""
        ctx = self.ctx
        cuda = ctx.device.type == "cuda"
        out: dict[str, Any] = {
            "accelerator": "cuda" if cuda else "cpu",
            "devices": [ctx.device.index] if cuda else 1,
        }
        if ctx.world_size == 1:
            return out
        for name in ("devices", "num_nodes", "accelerator"):
            if name in kwargs:
                raise ValueError(f"{name}: a Baton run of several ranks places its ranks")
        strategy = kwargs.pop("strategy", None)
        if strategy is None:
            strategy = BatonDDPStrategy()
        if not isinstance(strategy, BatonDDPStrategy):
            raise TypeError(
                f"strategy={strategy!r}: a Baton run of several ranks trains with"
                " BatonDDPStrategy (it takes DDPStrategy's arguments)"
            )
        # Its backend is the group's (Lightning's default for the device: gloo on CPU, NCCL
        # on CUDA, as `baton.runtime.group` chose).
        strategy.cluster_environment = BatonEnvironment(ctx)
        return out | {"strategy": strategy, "num_nodes": ctx.world_size}

    def logger(self) -> Any:
        """Lightning's default logger on the run's tracker run, the same for every attempt
        (`baton.integrations.lightning_loggers`); `trainer_kwargs` puts it in place of
        Lightning's default logger (`logger=True`, or none given); a logger you pass is
        yours. None without `[tracking]`."""
        if self.ctx.tracking is None:
            return None
        from baton.integrations.lightning_loggers import run_logger

        return run_logger(self.ctx.tracking)

    # -- checks, before anything runs ----------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        ctx = self.ctx
        problems = []
        if trainer.max_steps != ctx.total_steps:
            problems.append(f"max_steps={trainer.max_steps}, the job's total_steps is"
                            f" {ctx.total_steps}")  # fmt: skip
        if trainer.fit_loop.max_epochs not in (-1, None):
            problems.append(f"max_epochs={trainer.fit_loop.max_epochs} may end training early")
        if any(isinstance(cb, Timer) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            problems.append("max_time (a Timer) may end training early")
        if trainer.fit_loop.min_steps or trainer.fit_loop.min_epochs:
            problems.append("min_steps/min_epochs keep training past a stop Baton asks for")
        if (trainer.world_size, trainer.global_rank) != (ctx.world_size, ctx.rank):
            problems.append(
                f"Lightning runs rank {trainer.global_rank} of {trainer.world_size}, Baton"
                f" rank {ctx.rank} of {ctx.world_size}"
            )
        if ctx.world_size > 1 and not isinstance(trainer.strategy, BatonDDPStrategy):
            problems.append("several ranks train with BatonDDPStrategy")
        if ctx.spec.deterministic and not torch.are_deterministic_algorithms_enabled():
            problems.append("the job is deterministic, the Trainer turned that off")
        if problems:
            raise ValueError(
                "this Trainer cannot run under Baton: " + "; ".join(problems)
                + ". Build it with L.Trainer(**baton.trainer_kwargs(...))"
            )  # fmt: skip
        self.ckpt_path()  # the loop's resume, even where the script did not ask

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning has read the checkpoint by now (`resume_start`); it restores the loops
        # after this hook, so the step is checked in `on_train_start`.
        given = trainer.ckpt_path
        if self._ckpt is not None and (given is None or Path(given) != Path(self._ckpt)):
            raise ValueError(
                f"the run resumes from step {self.ctx.step}: call"
                " trainer.fit(..., ckpt_path=baton.ckpt_path())"
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self.ctx.step:
            raise RuntimeError(
                f"Lightning starts at step {trainer.global_step}, the run's checkpoint is of"
                f" step {self.ctx.step}"
            )
        if self._resumed_at_epoch_end:
            # Lightning has counted the saved epoch as done (`FitLoop.reset`) and would go
            # on as if restarted in the middle of the next one: neither counting that
            # epoch as started nor calling `on_train_epoch_start`. So its epoch counters
            # would lag the uninterrupted run's by one, and a later resume from a
            # checkpoint of this attempt would misread them. The next epoch begins anew.
            trainer.fit_loop.reset_restart_stage()
            self._resumed_at_epoch_end = False

    # -- every step ----------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            set_rng_state(*self._rng)
        self._before = _scalars(trainer.callback_metrics)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._rng = rng_state()  # every batch's, gradients accumulated or not
        step = trainer.global_step
        if step == self.ctx.step:
            return  # accumulating gradients: no optimizer step yet
        metrics = _fresh(self._before, _scalars(trainer.callback_metrics))
        self._before = {}
        at = self.loop.step_ended(step, **metrics)
        if at.save:
            self._save(trainer, pl_module, step)
        if at.stop:
            trainer.should_stop = True
            # Lightning validates when told to stop (for early stopping); the run is being
            # preempted and has saved: nothing is to run before `fit` returns.
            trainer.limit_val_batches = 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before = _scalars(trainer.callback_metrics)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = _fresh(self._before, _scalars(trainer.callback_metrics))
        self._before = {}
        if metrics and trainer.global_step == self.ctx.step:
            self.loop.reported(trainer.global_step, **metrics)

    def _save(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        where = self._saves / f"step-{step}"
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        with every_rank(trainer.strategy):
            trainer.save_checkpoint(where / CKPT, weights_only=False)
        self.loop.saved(step, where, weights=pl_module.state_dict())
        shutil.rmtree(where)  # Baton has its own links to the files

    # -- in the .ckpt --------------------------------------------------------------------

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint of an epoch's last step: resume at the next epoch's start.

        Saved in `on_train_batch_end` of the epoch's last batch, a `StatefulDataLoader`'s
        state has handed out every batch but not yet said so (`_iterator_finished` is
        false: no `StopIteration` was raised). Lightning restores its loops past that epoch
        and keeps the loader's resumed iterator, which then raises `StopIteration` at once:
        Lightning counts an empty epoch, and `current_epoch` is one ahead of the run that
        never stopped from then on (what a `DistributedSampler` shuffles by, what epoch
        schedules and `check_val_every_n_epoch` count). Marked as finished, the loader
        starts a new epoch at the next `iter()`, as it did in the uninterrupted run, its
        shuffle's generator where that run's was; and `on_train_start` lets that epoch
        begin as a new one (`_resumed_at_epoch_end`). Checked with Lightning 2.6,
        torchdata 0.11; `on_load_checkpoint` runs before Lightning loads loops and loaders."""
        fit = checkpoint.get("loops", {}).get("fit_loop", {})
        progress = fit.get("epoch_loop.batch_progress", {})
        total = progress.get("total", {})
        if not ends_epoch(progress.get("is_last_batch", False),
                           total.get("processed", 0), total.get("completed", 0)):  # fmt: skip
            return
        for state in fit.get("state_dict", {}).get("combined_loader", []):
            if isinstance(state, dict) and "_iterator_finished" in state:
                state["_iterator_finished"] = True
        self._resumed_at_epoch_end = True

    def state_dict(self) -> dict[str, Any]:
        if self._rng is None:
            return {}
        tensors, values = self._rng
        return {"rng": {"tensors": tensors, "values": values}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        if rng is not None:
            self._rng = (dict(rng["tensors"]), dict(rng["values"]))


def _scalars(metrics: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor) and v.numel() == 1}


def _fresh(before: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """The values logged since `before` was taken. Lightning keeps each logged value in a
    tensor of its own (a clone per `self.log`), and `before` holds the earlier ones alive,
    so a value logged again lives at another address; one left over lives where it did."""
    return {
        k: float(v)
        for k, v in now.items()
        if k not in before or v.data_ptr() != before[k].data_ptr()
    }
