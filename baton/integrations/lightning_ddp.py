"""Lightning's DDP on a Baton run's process group (`baton.integrations.lightning`): the
cluster environment (Baton created the processes and the group), the strategy (no launcher;
each rank's own part of the checkpoints Baton takes), and the training loader's resumable
order on several ranks. Checked against Lightning 2.6 and torchdata 0.11.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from baton.runtime.context import RunContext

CKPT = "lightning.ckpt"
"""The name of Lightning's checkpoint file in every directory Baton stores."""

_REPLICATED = ("state_dict", "optimizer_states")
"""What DDP keeps the same on every rank: only rank 0's .ckpt holds it."""


def rank_file(ckpt: str | Path, rank: int) -> Path:
    """Where rank `rank` (> 0) keeps its own part of the .ckpt at `ckpt`."""
    path = Path(ckpt)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class BatonEnvironment(ClusterEnvironment):
    """Baton's group, as Lightning sees a cluster: the processes exist already (one per
    rank, each started by its own trainer), the default process group is initialised, and
    each rank is a node of one device, so Lightning's global rank is Baton's rank."""

    def __init__(self, ctx: RunContext) -> None:
        self._rank = ctx.rank
        self._world_size = ctx.world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        """Never used: Lightning connects only when no process group exists yet."""
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False  # given explicitly, never picked by Lightning

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        if size != self._world_size:
            raise ValueError(
                f"Lightning counts {size} processes, the Baton run has {self._world_size}:"
                " build the Trainer with BatonCallback.trainer_kwargs()"
            )

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._rank:
            raise ValueError(
                f"Lightning makes this process rank {rank}, Baton's rank is {self._rank}:"
                " build the Trainer with BatonCallback.trainer_kwargs()"
            )

    def local_rank(self) -> int:
        return 0  # the only device of its node

    def node_rank(self) -> int:
        return self._rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices != 1 or num_nodes != self._world_size:
            raise ValueError(
                f"a Baton run of {self._world_size} ranks is Trainer(devices=1,"
                f" num_nodes={self._world_size}), not devices={num_devices},"
                f" num_nodes={num_nodes}: build it with BatonCallback.trainer_kwargs()"
            )


class BatonDDPStrategy(DDPStrategy):
    """Lightning's DDP on Baton's process group: launches nothing, and writes each rank's
    own part of the checkpoints Baton takes (see the module's docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every_rank = False
        """Set while Baton saves: every rank writes, not rank 0 alone."""

    def _configure_launcher(self) -> None:
        # Baton started the processes. Lightning's launcher would only validate the
        # settings (done in the callback's `setup`) and set torch's number of threads to
        # the host's cores, which changes a deterministic run's arithmetic.
        self._launcher = None

    def process_dataloader(self, dataloader: object) -> object:
        """Lightning has just given `dataloader` its distributed sampler; make its order a
        function of (seed, epoch) and the epoch the one being resumed (`resumable`)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            loop = trainer.fit_loop
            # As Lightning sets it when an epoch starts (its trackers are typed as their base).
            epoch: int = cast(Any, loop.epoch_progress.current).processed
            progress = loop.epoch_loop.batch_progress
            total: Any = progress.total
            if ends_epoch(progress.is_last_batch, total.processed, total.completed):
                epoch += 1  # the resumed loader starts the next one (`on_load_checkpoint`)
            resumable(dataloader, epoch)
        return dataloader

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.is_global_zero or not self.every_rank:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        own = {k: v for k, v in checkpoint.items() if k not in _REPLICATED}
        path = rank_file(filepath, self.global_rank)
        self.checkpoint_io.save_checkpoint(own, path, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.global_rank == 0 or Path(checkpoint_path).name != CKPT:
            return checkpoint
        own = rank_file(checkpoint_path, self.global_rank)
        if not own.is_file():
            raise FileNotFoundError(
                f"{own.name}: the checkpoint holds no state of rank {self.global_rank}"
            )
        checkpoint.update(self.checkpoint_io.load_checkpoint(own, weights_only=weights_only))
        return checkpoint


def ends_epoch(last_batch: bool, processed: int, completed: int) -> bool:
    """Whether Lightning's batch progress is that of a checkpoint saved in
    `on_train_batch_end` (processed, not yet completed) of an epoch's last batch."""
    return bool(last_batch) and completed == processed - 1


def resumable(dataloader: object, epoch: int) -> None:
    """Make a training loader's order on several ranks resumable, before Lightning first
    iterates it (and loads the position it is resumed at).

    For a `StatefulDataLoader(shuffle=True)` Lightning sees a sampler that is not torch's
    `RandomSampler` (torchdata's own) and wraps it in a `DistributedSamplerWrapper`, which
    draws the whole shuffle of the inner sampler again at every `iter()`, from a generator
    the loader's state does not hold; and torchdata's resumed iterator calls `iter()` twice.
    So a resumed epoch would be dealt from another shuffle. It is given instead what
    Lightning gives a shuffled torch `DataLoader`: a `DistributedSampler` with the
    wrapper's seed, shuffling by (seed, epoch), whose position the loader's state does hold
    (a count of indices, skipped on resume without reading a sample). Checked with
    Lightning 2.6 and torchdata 0.11.

    And the epoch: Lightning sets it when an epoch starts, after the resumed iterator was
    made, so without it a run resumed in epoch 2 would deal epoch 0's order."""
    batches = getattr(dataloader, "batch_sampler", None)
    wrapper = getattr(batches, "sampler", None)
    if (
        isinstance(dataloader, StatefulDataLoader)
        and isinstance(wrapper, DistributedSamplerWrapper)
        and isinstance(getattr(wrapper.dataset, "_sampler", None), StatefulRandomSampler)
    ):
        batches.sampler = DistributedSampler(  # type: ignore[union-attr]
            dataloader.dataset,
            num_replicas=wrapper.num_replicas,
            rank=wrapper.rank,
            shuffle=wrapper.shuffle,
            seed=wrapper.seed,
            drop_last=wrapper.drop_last,
        )
    _set_sampler_epoch(dataloader, epoch)


@contextmanager
def every_rank(strategy: Any) -> Iterator[None]:
    if not isinstance(strategy, BatonDDPStrategy):
        yield
        return
    strategy.every_rank = True
    try:
        yield
    finally:
        strategy.every_rank = False
