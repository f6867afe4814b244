"""`RunContext`: the whole API a training entry point sees.

    def train(ctx: RunContext) -> None:
        model, opt = build(ctx.config)
        ctx.restore(model=model, optimizer=opt)      # no-op on a fresh run
        for step in ctx.steps():                     # resumes at the committed step
            loss = ...
            ctx.report(loss=loss.item())

`steps()` takes care of everything else: checkpoints on the job's policy or when the trainer
asks (preemption), stopping when told to, and the final checkpoint. Resume is exact when the
job is deterministic: everything registered with `restore()` (`baton.runtime.slots` says what can
be), the data cursor and the global RNGs are restored, and a checkpoint holds each of them
as it was at the step it names. `data_loader()` gives the common case's data position.

In deterministic mode a run also checks itself: an attempt that resumes compares its first
steps' metrics with what an earlier attempt reported after the same checkpoint, and tells
the trainer if they differ (`baton.runtime.witness`).

A run of several ranks (`ctx.rank`, `ctx.world_size`; `baton.runtime.group`) runs the entry
point in every rank's process, which may wrap its model in `DistributedDataParallel`, or
shard it with FSDP2's `fully_shard`. All ranks stop and checkpoint at the same step, agreed
once per step (one all-reduce), and a checkpoint is one commit of every rank's files. What
each rank writes, and how a checkpoint is found and loaded, is `baton.runtime.checkpoints`.

`data_parallel()` is data parallelism whose result does not depend on the group's size
(`baton.runtime.exact`): a fixed global batch of virtual shards, each computed whole by one
rank under its own RNG stream, their gradients gathered and summed in shard order, so an
elastic run's weights are the same bits at 1, 2 or 3 ranks, however its size changed. Its
data position is derived from the step, so it registers nothing with `restore()`.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from baton.runtime import compat, guard, witness
from baton.runtime.boundary import StepBoundary
from baton.runtime.checkpoints import Checkpoints
from baton.runtime.data import Batches
from baton.runtime.replica import Replica
from baton.runtime.slots import slots_for
from baton.tracking.rows import SLOT as TRACKING_SLOT
from baton.tracking.tracker import Tracker
from shared.contracts import Task
from shared.contracts.child import FromChild, Loaded, Tripped
from shared.contracts.records import Skip

if TYPE_CHECKING:  # a single-rank run never imports torch.distributed's machinery
    from baton.runtime.exact import DataParallel, MapDataset
    from baton.runtime.group import Group


class RunContext(StepBoundary):
    def __init__(
        self,
        task: Task,
        token: int,
        store_url: str,
        spool: Path,
        send: Callable[[FromChild], None],
        launched_at: float | None = None,
        group: Group | None = None,
        skips: list[Skip] | None = None,
        allow_changes: bool = False,
    ) -> None:
        self._launched_at = time.monotonic() if launched_at is None else launched_at
        """When the training process was handed the task (monotonic): the entry point's own
        set-up is what passes between it and `restore()`."""
        self.run_id = task.run_id
        self.spec = task.spec
        self.config: dict[str, Any] = dict(task.spec.config)
        self.seed = task.spec.seed
        self.total_steps = task.spec.total_steps
        self._group = group
        self.rank = group.rank if group else 0
        self.world_size = group.world_size if group else 1
        self.local_rank = group.local_rank if group else 0
        """This rank's index among the group's ranks on its host."""
        self.device = _device(self.local_rank)
        self.replica = task.spec.replica or 0
        """This replica's index in a replicated run (`spec.replicas`; docs/diloco.md)."""
        self.replicas = task.spec.max_replicas
        self._replica = Replica(task, store_url, send, group) if task.spec.replicated else None
        self.step = 0
        """Steps completed so far; the next step to run."""
        self.cursor: dict[str, Any] = {}
        """JSON-able position in the data, saved with every checkpoint (as it is when the
        checkpoint is taken, between steps). Entry points that derive their batches from
        `step`, or draw them from `data_loader()`, need not use it."""
        self.token = token
        """The fencing token every file of this attempt is written under; in a group, the
        group's epoch, the same for every rank."""
        self._send = send
        self._loaders: dict[str, Batches] = {}
        self._metrics: dict[str, float] = {}
        self._step_metrics: dict[str, float] = {}
        # Rank 0's metrics stand for the run's: only its steps are checked.
        self._witness = witness.Witness(enabled=task.spec.deterministic and self.rank == 0)
        self._guard = guard.Watch(task.spec.guard, enabled=self.rank == 0)
        self._refused: Tripped | None = None
        """A checkpoint the guard refused on the writer thread (`_vet`)."""
        self._skips = skips or []
        self._allow_changes = allow_changes
        """The operator let a deterministic run resume under other software (`compat`)."""
        self._spool = spool
        self._checkpoints = Checkpoints(task, token, store_url, spool, send, group, self._vet)
        self._lock = threading.Lock()
        self._want_checkpoint = False
        self._want_stop = False
        self._agreed_stop = False
        """In a group: whether any rank was told to stop, as agreed at the last step boundary."""
        self._last_report = 0.0
        self.finished_early = False
        self.tracking = (
            Tracker(task.spec.tracking, self.run_id, self.rank) if task.spec.tracking else None
        )
        """The run's experiment tracker (`[tracking]`; docs/tracking.md), None without one:
        `ctx.tracking.purge_step`, `ctx.tracking.summary_writer()`."""

    # -- the public API ------------------------------------------------------------------

    def restore(self, **state: Any) -> int:
        """Register what to checkpoint and load the newest committed checkpoint into it, if
        there is one. Returns the step to continue from.

        Accepted: objects with `state_dict()`/`load_state_dict()` (model, optimizer,
        scheduler, `GradScaler`, torchdata's `StatefulDataLoader` — its generator included),
        `torch.Generator` objects, and dicts/lists of JSON values (put back in place). The
        first registered object's tensors are the weights the run's digest is taken of.
        Anything else is refused with a `TypeError` naming it."""
        self._checkpoints.slots = slots_for(self._registered(state))
        began = time.monotonic()
        found = asyncio.run(self._checkpoints.find(self._witness.enabled))
        manifest, damaged, rows = found.manifest, found.damaged, found.rows
        resharded, read, changed = 0, 0, []
        resumed = self._checkpoints.resume_local(found.latest, behind=bool(damaged))
        if resumed is not None:
            manifest = None
        elif manifest is not None:
            resumed = self._checkpoints.load(manifest)
        if resumed is not None:
            changed = compat.changes(resumed.versions, compat.recorded(self.spec.entry_point))
            if changed and self.spec.deterministic and not self._allow_changes:
                raise compat.Changed(
                    f"checkpoint {resumed.step} was written under other software: "
                    f"{'; '.join(changed)}. A deterministic run is not resumed so unless its "
                    "operator allows it (baton resume RUN --allow-changes)"
                )
            self.step, read = resumed.step, resumed.read_bytes
            self.cursor.clear()  # in place, like registered dicts: a reference taken earlier
            self.cursor.update(resumed.cursor)  # is still the one saved
            if manifest and manifest.sharded and manifest.ranks != self.world_size:
                resharded, rows = manifest.ranks, None  # no witness across sizes: see shards
                print(f"baton: resumed step {self.step} written by {manifest.ranks} rank(s) at"
                      f" {self.world_size}; rank {self.rank} read {read} bytes of shards; not"
                      " bitwise the run at the old size from here", file=sys.stderr)  # fmt: skip
        self._skip_rolled_back()
        if self.tracking is not None:  # what the store's newest commit kept, at most
            kept = found.latest.step if found.latest is not None else 0
            self.tracking.resumed(self.step, min(self.step, kept))
        if self._replica is not None:
            self._replica.attach(next(iter(state.values()), None))
        took = time.monotonic() - began
        if not self._checkpoints.resumed_local:  # a witness follows a committed checkpoint
            self._witness.resumed(self.step, rows)
        setup = max(0.0, began - self._launched_at)
        self._send(Loaded(step=self.step, damaged=damaged, took_s=took, setup_s=setup,
                          resharded_from=resharded, read_bytes=read, changed=changed,
                          local=self._checkpoints.resumed_local))  # fmt: skip
        return self.step

    def data_loader(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int | None = None,
        name: str = "data",
        **loader_options: Any,
    ) -> Batches:
        """An endless stream of batches over a map-style dataset, reshuffled every epoch
        from the run's seed (or `seed`), that resumes mid-epoch at exactly the next batch,
        with any `num_workers`. Registered under `name` by itself: call this before
        `restore()`, then draw one batch per step:

            batches = ctx.data_loader(dataset, batch_size=32, num_workers=2)
            ctx.restore(model=model, optimizer=opt)
            for step in ctx.steps():
                x, y = next(batches)

        Extra keyword arguments go to torchdata's `StatefulDataLoader` (`pin_memory`, …).
        In a run of several ranks each rank draws its own share of every epoch
        (`baton.runtime.data`)."""
        if self._checkpoints.slots:
            raise RuntimeError("call data_loader() before restore(), which loads its position")
        if self.spec.elastic:
            # Its position is each rank's own share of the epoch, which has no meaning at
            # another group size: an elastic run's checkpoint must resume at any size.
            raise ValueError(
                "data_loader() keeps a data position per rank, which an elastic run (ranks "
                "given as a range) cannot carry to another group size: draw batches with "
                "ctx.data_parallel(), or derive them from the step"
            )
        if name in self._loaders:
            raise ValueError(f"a data loader named {name!r} is registered already")
        batches = Batches(
            dataset,
            batch_size=batch_size,
            seed=self.seed if seed is None else seed,
            shuffle=shuffle,
            num_workers=num_workers,
            drop_last=drop_last,
            collate_fn=collate_fn,
            rank=self.replica * self.world_size + self.rank,  # each replica its own share too
            world_size=self.replicas * self.world_size,
            **loader_options,
        )
        self._loaders[name] = batches
        return batches

    def data_parallel(
        self,
        model: torch.nn.Module,
        dataset: MapDataset,
        *,
        batch_size: int,
        shards: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int | None = None,
    ) -> DataParallel:
        """Exact data parallelism over the group (`baton.runtime.exact`): each step's global
        batch is `shards` virtual shards of `batch_size` samples (by default as many shards
        as the job's largest number of ranks), and the result is the same bits at any group
        size. The batches come from the step alone (reshuffled every epoch from the run's
        seed, or `seed`), so nothing needs registering:

            dp = ctx.data_parallel(model, dataset, batch_size=16)
            ctx.restore(model=model, optimizer=opt, scheduler=sched)
            for step in ctx.steps():
                for shard in dp.shards(step):
                    x, y = shard.batch
                    shard.backward(loss_fn(model(x), y))
                ctx.report(loss=dp.sync())  # the mean gradient is in .grad on every rank
                opt.step()
        """
        from baton.runtime.exact import DataParallel

        return DataParallel(
            model, dataset, batch_size=batch_size,
            shards=self.spec.max_ranks if shards is None else shards,
            seed=self.seed if seed is None else seed,
            rank=self.rank, world_size=self.world_size, collate_fn=collate_fn,
        )  # fmt: skip

    def steps(self) -> Iterator[int]:
        """Yield step numbers from the resume point to `total_steps`, checkpointing as
        the policy says and stopping (after a checkpoint) when the trainer asks."""
        if not self._checkpoints.slots:
            raise RuntimeError("call ctx.restore(model=..., ...) before ctx.steps()")
        while self.step < self.total_steps:
            if self.should_stop:
                self._save(final=False)
                self.finished_early = True
                return
            yield self.step
            self.step += 1
            self._after_step()
        if self._replica is not None:
            self._replica.finished(self.step)
        self._save(final=True)

    def report(self, **metrics: float) -> None:
        """Record metrics for the current step (loss, accuracy, …); sent to the trainer."""
        values = {k: float(v) for k, v in metrics.items()}
        self._metrics.update(values)
        self._step_metrics.update(values)

    def checkpoint(self) -> None:
        """Checkpoint now. Blocks only for the copy into host memory. In a group, every rank
        must call it at the same step (rank 0 waits for every rank's files)."""
        self._save(final=False)

    @property
    def should_stop(self) -> bool:
        if self._group is not None:
            return self._agreed_stop  # the same on every rank, so all of them stop together
        with self._lock:
            return self._want_stop

    # -- called by the child's control thread --------------------------------------------

    def request(self, action: str, token: int = 0, step: int = 0) -> None:
        with self._lock:
            if action == "checkpoint":
                self._want_checkpoint = True
            elif action == "stop":
                self._want_stop = True
            elif action == "token" and token > self.token and self._group is None:
                # A group's files are all written under its epoch, whoever holds which lease.
                self.token = token
        if action == "committed" and self.tracking is not None:
            self.tracking.committed(step)

    def close(self) -> None:
        completed = self.step >= self.total_steps
        self._checkpoints.close(completed=completed)
        self._guarded(None)  # the final checkpoint refused by the guard: no finish
        if self.tracking is not None:
            ckpts, token = self._checkpoints, self.token
            self.tracking.close(ckpts.last_saved, completed, lambda: ckpts.newest_commit(token))

    # -- internals -----------------------------------------------------------------------

    def _registered(self, state: dict[str, Any]) -> dict[str, Any]:
        """What `restore(**state)` registers: `state`, the data loaders, a replica's outer
        state; refused if empty, given twice, or registered before."""
        registered = {**state, **{n: b for n, b in self._loaders.items() if n not in state}}
        if not registered:
            raise ValueError("restore() needs at least one object, e.g. restore(model=model)")
        if self._replica is not None:  # its outer state, checkpointed with the rest
            registered["baton_outer"] = self._replica
        if self.tracking is not None:  # the rows no commit has kept yet (baton.tracking.rows)
            registered[TRACKING_SLOT] = self.tracking.rows.state
        if self._checkpoints.slots:
            raise RuntimeError("restore() registers state once per run; call it once")
        seen: dict[int, str] = {}
        for name, obj in registered.items():
            if id(obj) in seen and not isinstance(obj, bool | int | float | str):
                raise ValueError(f"restore(): {name!r} is the same object as {seen[id(obj)]!r}")
            seen[id(obj)] = name
        return registered


def _device(local_rank: int) -> torch.device:
    """The rank's device: with CUDA, one of the host's GPUs by local rank (a trainer under
    `baton up` sees only its own GPU, so that is cuda:0); the CPU otherwise."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
