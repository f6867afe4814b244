"""Hugging Face Accelerate under Baton: an `Accelerator` training loop, resumable, with a
few lines added.

    from baton.integrations.accelerate import AcceleratedRun, make_accelerator

    def train(ctx: RunContext) -> None:
        accelerator = make_accelerator(ctx)                  # instead of Accelerator()
        model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
        run = AcceleratedRun(ctx, accelerator, model)
        run.resume()                                         # load_state() of the newest commit
        for batch in run.batches(loader):                    # epoch after epoch, from where it was
            with accelerator.accumulate(model):
                ...                                          # forward, accelerator.backward(loss),
                                                             # opt.step(), sched.step(), zero_grad
            if accelerator.sync_gradients and run.step_ended(loss=loss.item()).stop:
                break

**Why these pieces.** Accelerate owns the loop and its checkpoint (`save_state` writes the
model, optimizers, schedulers, scaler, registered objects and each process's RNG states;
`load_state` reads them back); Baton owns when to save, where the files go, which attempt
may commit them and which checkpoint a resumed attempt starts from
(`baton.runtime.external`). `AcceleratedRun` joins the two: at each optimizer step it asks
Baton's step boundary (the same on every rank) whether to save, and when to, every rank
calls `save_state` into a fresh directory of its own, which Baton stores and commits as one
checkpoint; on resume, every rank gets every rank's files in one directory (the layout
`save_state` makes on a shared file system) for `load_state`.

**The process group.** In a run of several ranks Baton has set up the default
torch.distributed group before the entry point runs. Accelerate's `PartialState` only calls
`init_process_group` when no group is initialized, but reads which kind of run it is from
the environment (`LOCAL_RANK`, `WORLD_SIZE`; on a host without a GPU only with `cpu=True`),
so `make_accelerator` sets those from the `RunContext` and checks that the `Accelerator`
sees the group Baton made: its size, this process's rank and the device `ctx.device` names.

**The data position.** A checkpoint is exact only if the resumed loop draws the same batches.
Accelerate's default shuffling draws each epoch's order from a generator whose state no
checkpoint holds; `make_accelerator` turns on `use_seedable_sampler` (an epoch's order is a
function of `data_seed` and the epoch) with the run's seed. `batches()` keeps the position
(epoch, batches drawn in it) and saves it beside Accelerate's files (`baton_position.json`);
a resume sets the epoch and skips what the epoch had drawn with Accelerate's
`skip_first_batches` (which skips indices, loading no sample), or, with
`use_stateful_dataloader`, lets the data loader's own restored state (`dl_state_dict.bin`)
carry it there. Creating a data loader's iterator draws a seed from the global RNG (torch's
`_BaseDataLoaderIter`, for its workers); the uninterrupted run drew it before the checkpoint,
so on resuming mid-epoch that draw is undone.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Accelerate ships no type information (no py.typed): its objects are `Any` here.
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import (  # type: ignore[import-untyped]
    DataLoaderConfiguration,
    DistributedType,
)

from baton.runtime.context import RunContext
from baton.runtime.external import ExternalLoop
from shared.checkpoint.files import rank_prefix

POSITION = "baton_position.json"
"""The data position, saved beside Accelerate's own files."""

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
"""Kinds of runs whose `save_state` writes plain files: one process, or data parallelism
(DDP). FSDP, DeepSpeed and Megatron-LM write directories of shards, which
`baton.runtime.external` does not store."""

_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Position:
    """Where the data is: `epoch`, and how many batches of it were drawn."""

    epoch: int = 0
    batch: int = 0


@dataclass(frozen=True)
class Resumed:
    """What `AcceleratedRun.resume` loaded."""

    step: int
    """Optimizer steps done: the step the run continues from (0 on a fresh run)."""
    epoch: int
    """The epoch the next batch is drawn from."""
    skip: int
    """Batches of that epoch drawn before the checkpoint, which `batches()` skips."""


@dataclass(frozen=True)
class Stepped:
    """What `AcceleratedRun.step_ended` did at a step, the same on every rank."""

    step: int
    """Optimizer steps done."""
    saved: bool
    """A checkpoint of this step was saved (`save_state`) and handed to Baton."""
    stop: bool
    """End the loop now: the last step is done, or the run was told to stop (preemption,
    cancellation) and this step's checkpoint is saved."""


def make_accelerator(ctx: RunContext, **options: Any) -> Accelerator:
    """The `Accelerator` of this rank of the run: `Accelerator(**options)` on the group and
    device Baton set up. Unless `dataloader_config` is given, data loaders shuffle with
    `use_seedable_sampler` from the run's seed (see the module's docstring)."""
    if options.get("cpu") is not None and bool(options["cpu"]) != (ctx.device.type == "cpu"):
        raise ValueError(f"cpu={options['cpu']!r}: this rank's device is {ctx.device}")
    options["cpu"] = ctx.device.type == "cpu"
    project = options.get("project_config")
    if project is not None and project.automatic_checkpoint_naming:
        raise ValueError(
            "automatic_checkpoint_naming: Baton decides where a checkpoint goes and which one a"
            " run resumes from; leave it off"
        )
    if options.get("dataloader_config") is None:
        options["dataloader_config"] = DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=ctx.seed
        )
    _set_environment(ctx)
    accelerator = Accelerator(**options)
    check(ctx, accelerator)
    return accelerator


def _set_environment(ctx: RunContext) -> None:
    """The variables Accelerate reads to learn which process of which run this is."""
    if ctx.world_size == 1:
        # A launcher's variables (a trainer started under torchrun) must not make Accelerate
        # set up a group for a run of one rank.
        for name in _RANK_VARIABLES:
            os.environ.pop(name, None)
        return
    if not torch.distributed.is_initialized():
        raise RuntimeError("a run of several ranks without its process group")
    os.environ.update(
        RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size), LOCAL_RANK=str(ctx.local_rank)
    )
    if ctx.device.type == "cpu":
        # Without OMP_NUM_THREADS, Accelerate sets torch's thread count to its guess; the
        # count is the training process's (a deterministic run's is 1), and a different one
        # sums in another order.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        # Accelerate refuses a CPU group spread over hosts without a rendezvous address. It
        # never uses it: the group exists, and only a missing one is initialized from it.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def check(ctx: RunContext, accelerator: Accelerator) -> None:
    """Refuse an `Accelerator` that does not run on this rank's group and device, or whose
    checkpoints are not plain files."""
    state = accelerator.state
    if state.distributed_type not in _SUPPORTED:
        raise ValueError(
            f"{state.distributed_type}: Baton stores a checkpoint made of plain files, which"
            " Accelerate writes for one process or data parallelism (DDP), not for FSDP,"
            " DeepSpeed or Megatron-LM"
        )
    seen = (accelerator.num_processes, accelerator.process_index)
    if seen != (ctx.world_size, ctx.rank):
        raise RuntimeError(
            f"the Accelerator sees process {seen[1]} of {seen[0]}, the run is rank {ctx.rank}"
            f" of {ctx.world_size}: was one made before make_accelerator() (its state is"
            " shared by every Accelerator of the process)?"
        )
    device = accelerator.device
    if device.type != ctx.device.type or (
        device.type != "cpu" and (device.index or 0) != (ctx.device.index or 0)
    ):
        raise RuntimeError(f"the Accelerator runs on {device}, this rank's device is {ctx.device}")


class AcceleratedRun:
    """An `Accelerator` loop's checkpoints and step boundaries, run by Baton."""

    def __init__(self, ctx: RunContext, accelerator: Accelerator, model: torch.nn.Module) -> None:
        """`model` is the prepared model whose weights the run's digest is taken of (its
        unwrapped state_dict, the same on every rank)."""
        check(ctx, accelerator)
        self.ctx = ctx
        self.accelerator = accelerator
        self.model = model
        self._loop = ExternalLoop(ctx)
        self._resumed: Resumed | None = None
        self._position = Position()
        """Where the next batch comes from, as a checkpoint now would save it."""
        self._epoch = 0

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.ctx.step

    @property
    def done(self) -> bool:
        return self.ctx.step >= self.ctx.total_steps

    @property
    def epoch(self) -> int:
        """The epoch of the batch `batches()` drew last."""
        return self._epoch

    def resume(self) -> Resumed:
        """Load the newest committed checkpoint into everything `accelerator.prepare()` and
        `register_for_checkpointing()` were given (`load_state`); on a fresh run, nothing.
        Call it once, after `prepare()` and before the first step, on every rank."""
        if self._resumed is not None:
            return self._resumed
        if not self.accelerator._models:
            raise RuntimeError("call accelerator.prepare(...) before resume(): load_state()"
                               " loads what was prepared")  # fmt: skip
        where = self._loop.resume()
        position = Position()
        if where is not None:
            self.accelerator.load_state(str(where))
            saved = where / POSITION
            if saved.exists():
                raw = json.loads(saved.read_text())
                position = Position(epoch=int(raw["epoch"]), batch=int(raw["batch"]))
            shutil.rmtree(where, ignore_errors=True)  # loaded: every file's bytes are in use
        self._position = position
        self._epoch = position.epoch
        self._resumed = Resumed(step=self.ctx.step, epoch=position.epoch, skip=position.batch)
        return self._resumed

    def batches(self, loader: Any) -> Iterator[Any]:
        """The prepared `loader`'s batches, epoch after epoch without end, from the resumed
        position on; stop drawing when `step_ended` says so. The position is saved with every
        checkpoint."""
        start = self.resume()
        epoch, skip = start.epoch, start.skip
        stateful = bool(getattr(loader, "use_stateful_dataloader", False))
        _check_sampler(loader)
        if stateful and not skip and start.step:
            # Saved after an epoch's last batch: the state restored is of an epoch done, from
            # which torchdata starts the next one with a second iterator, drawing a second
            # seed; the uninterrupted run started it with one.
            base: Any = getattr(loader, "base_dataloader", None)
            if getattr(base, "next_iter_state", None) is not None:
                base.next_iter_state = None
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            source = loader
            if skip and not stateful:
                source = self.accelerator.skip_first_batches(loader, skip)
            # Resuming mid-epoch: the iterator's seed draw was made before the checkpoint.
            undo = torch.random.get_rng_state() if skip else None
            drawn = skip
            for batch in source:
                if undo is not None:
                    torch.random.set_rng_state(undo)
                    undo = None
                drawn += 1
                # A checkpoint after an epoch's last batch resumes at the next epoch's first.
                last = bool(getattr(source, "end_of_dataloader", False))
                self._position = Position(epoch + 1, 0) if last else Position(epoch, drawn)
                self._epoch = epoch
                yield batch
            if undo is not None:
                torch.random.set_rng_state(undo)
            epoch, skip = epoch + 1, 0
            self._position = Position(epoch, 0)

    def step_ended(self, **metrics: float) -> Stepped:
        """An optimizer step is done, with its `metrics` (rank 0's are the run's). Every rank
        calls this at every optimizer step — with gradient accumulation, when
        `accelerator.sync_gradients` is set. Saves a checkpoint when Baton's policy, the
        trainer, or the last step asks for one."""
        if self._resumed is None:
            raise RuntimeError("call resume() before the first step, even on a fresh run")
        if not self.accelerator.sync_gradients:
            raise RuntimeError(
                "step_ended() between accumulated micro-batches: call it once per optimizer"
                " step, when accelerator.sync_gradients is set"
            )
        step = self.ctx.step + 1
        at = self._loop.step_ended(step, **metrics)
        if at.save:
            self._save(step)
        return Stepped(step=step, saved=at.save, stop=at.stop or step >= self.ctx.total_steps)

    def reported(self, **metrics: float) -> None:
        """More metrics of the step just ended (an evaluation's)."""
        self._loop.reported(self.ctx.step, **metrics)

    def _save(self, step: int) -> None:
        ctx = self.ctx
        # A fresh directory per rank and step: Baton links the files aside, Accelerate's next
        # save must write new ones (see baton.runtime.external).
        where = ctx._spool / f"{rank_prefix(ctx.rank)}accelerate-{ctx.token}-{step}"
        shutil.rmtree(where, ignore_errors=True)
        self.accelerator.save_state(str(where))
        p = self._position
        (where / POSITION).write_text(json.dumps({"epoch": p.epoch, "batch": p.batch}))
        weights = self.accelerator.unwrap_model(self.model).state_dict()
        self._loop.saved(step, where, weights=weights)
        shutil.rmtree(where, ignore_errors=True)  # linked aside (or copied) by saved()


def _check_sampler(loader: Any) -> None:
    """Refuse a loader that shuffles from a generator no checkpoint holds."""
    from accelerate.data_loader import SeedableRandomSampler  # type: ignore[import-untyped]
    from torch.utils.data import RandomSampler

    get = getattr(loader, "get_sampler", None)
    sampler = get() if get is not None else getattr(loader, "sampler", None)
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        raise ValueError(
            "the data loader shuffles from a generator no checkpoint holds, so a resumed run"
            " would draw other batches: make the Accelerator with"
            " DataLoaderConfiguration(use_seedable_sampler=True) (make_accelerator's default)"
        )
