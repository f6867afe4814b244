"""Data parallelism whose result does not depend on the number of ranks.

An elastic run may train on 2 ranks, checkpoint, and resume on 3 or on 1. Its weights can
only come out the same if every step computes the same bits whatever the group's size, and
plain data parallelism does not: DDP (and any all-reduce) sums each rank's gradient over its
own share of the batch, so both the shares and the order of the floating-point adds follow
the group — gloo's ring or tree is exact at a fixed size, not across sizes.

So the size is taken out of the arithmetic:

* **A fixed global batch, cut into a fixed number V of virtual shards**, each of
  `batch_size` samples, with its own RNG stream. Which samples a shard takes is derived from
  the seed and the step alone (one permutation per epoch), so a checkpoint needs nothing
  from this helper and a group of any size can resume any step.
* **Each rank computes whole shards**: rank r of w owns the contiguous block
  `[r*V//w, (r+1)*V//w)`, and runs one forward and backward per shard, its gradients cleared
  before each, so a shard's gradient is the same bits whoever computes it. While a shard's
  code runs, the global RNG (CPU, and the model's CUDA device) is forked and seeded from
  (seed, step, shard): `nn.Dropout` draws the same masks for it on any rank, and the
  caller's RNG is left as it was.
* **A fixed-order sum**: the shards' flat gradients (and their losses, one more column) are
  all-gathered, and every rank adds them up in shard order 0..V-1, one float add at a time,
  then divides by V. Every rank holds the same bits at every size, so optimizer states stay
  identical on all ranks without ever being exchanged.

What it costs: one all-gather per step of V×P values (P trainable parameters, one dtype;
padded to w×ceil(V/w) rows) where DDP all-reduces P, with no overlap of communication and
backward; per rank V/w backwards of `batch_size` samples where DDP runs one of
V×batch_size/w; a copy of each shard's gradient, and V-1 adds of P. With V the run's
largest number of ranks, a rank at that size runs one backward, as under DDP, and smaller
groups run more, smaller ones: on 2 CPU cores, 0.82–1.21× DDP's steps/s with V = 2,
0.60–0.92× with V = 4 (`docs/benchmarks.md`, "Elastic runs: the cost of exactness"). V is
part of the result: the same V gives the same bits at any size, another V other bits. Equal
bits also need the same device type and kernels (`deterministic = true`). Only gradients
are combined: buffers that a forward updates (BatchNorm's running statistics) follow each
rank's own shards, so such models are not exact across sizes.

    dp = DataParallel(model, dataset, batch_size=16, shards=4, seed=7, rank=r, world_size=w)
    for step in range(steps):
        for shard in dp.shards(step):
            x, y = shard.batch
            shard.backward(loss_fn(model(x), y))
        loss = dp.sync()          # the global mean gradient is in every parameter's .grad
        opt.step()
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import default_collate


class MapDataset(Protocol):
    """What a map-style dataset gives: a length, and sample `i` for every `i` below it."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...


def derive_seed(*parts: object) -> int:
    """A well-mixed 63-bit seed from `parts` (a purpose and numbers): nearby steps and shards
    get unrelated streams, not consecutive seeds."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


class Shard:
    """One virtual shard of one step, as the rank that owns it sees it."""

    def __init__(
        self, owner: DataParallel, step: int, index: int, batch: Any, generator: torch.Generator
    ) -> None:
        self.index = index
        self.batch = batch
        """The shard's `batch_size` samples, collated and moved to the model's device."""
        self.generator = generator
        """A generator on the model's device, seeded from (seed, step, shard index): for
        randomness of the shard's own (noise, masks) drawn explicitly."""
        self._owner = owner
        self._step = step

    def backward(self, loss: Tensor) -> None:
        """Backward of this shard's loss (a scalar: its mean over the shard, as usual); its
        gradients and the loss are kept for `DataParallel.sync`, the model's cleared."""
        self._owner._backward(self, loss)


class DataParallel:
    """Exact data parallelism over `shards` virtual shards of `batch_size` samples each (see
    the module's docstring). `model` is the plain module, not wrapped in DDP."""

    def __init__(
        self,
        model: nn.Module,
        dataset: MapDataset,
        *,
        batch_size: int,
        shards: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if batch_size < 1 or shards < 1:
            raise ValueError(f"batch_size and shards must be at least 1: {batch_size}, {shards}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of a group of {world_size}")
        if shards < world_size:
            raise ValueError(
                f"shards={shards} is fewer than the {world_size} ranks: every rank computes"
                " whole shards, so some rank would have none. Give at least as many shards as"
                " the run's largest number of ranks (the result is the same for any shards >="
                " ranks of a fixed count, not across counts of shards)"
            )
        self.batch_size = batch_size
        self.num_shards = shards
        self.global_batch = shards * batch_size
        self.steps_per_epoch = len(dataset) // self.global_batch
        """Whole global batches per epoch; the rest of an epoch is dropped."""
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, less than one global batch of"
                f" {shards} shards x {batch_size} = {self.global_batch}"
            )
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"world_size={world_size} needs torch.distributed set up")
            if (dist.get_world_size(group), dist.get_rank(group)) != (world_size, rank):
                raise ValueError(
                    f"the process group is rank {dist.get_rank(group)} of"
                    f" {dist.get_world_size(group)}, not rank {rank} of {world_size}"
                )
        self.model = model
        self.dataset = dataset
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self._collate = collate_fn or default_collate
        self._group = group
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no parameter that requires a gradient")
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) != 1:
            raise ValueError(f"the model's trainable parameters must share a dtype: {dtypes}")
        self.device = self._params[0].device
        self._size = sum(p.numel() for p in self._params)
        self._rows = -(-shards // world_size)  # every rank sends as many, used or not
        self._send = torch.zeros(self._rows, self._size + 1, dtype=dtypes.pop(),
                                 device=self.device)  # fmt: skip
        self._gathered = [self._send] if world_size == 1 else [
            torch.empty_like(self._send) for _ in range(world_size)
        ]  # fmt: skip
        self._perm: tuple[int, Tensor] | None = None
        self._step: int | None = None
        self._pending: set[int] = set()

    # -- where the data and the shards are ----------------------------------------------

    def owner(self, shard: int) -> int:
        """The rank that computes `shard`: the last rank whose block starts at or before it."""
        return max(r for r in range(self.world_size) if self._first(r) <= shard)

    @property
    def owned(self) -> range:
        """This rank's shards."""
        return range(self._first(self.rank), self._first(self.rank + 1))

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int, shard: int) -> list[int]:
        """The dataset indices shard `shard` of step `step` takes, from the step alone."""
        epoch = self.epoch(step)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(derive_seed("epoch", self.seed, epoch))
            self._perm = (epoch, torch.randperm(len(self.dataset), generator=g))
        start = (step % self.steps_per_epoch) * self.global_batch + shard * self.batch_size
        return [int(i) for i in self._perm[1][start : start + self.batch_size]]

    # -- one step ------------------------------------------------------------------------

    def shards(self, step: int) -> Iterator[Shard]:
        """This rank's shards of `step`, in order. The model's gradients are cleared first;
        each shard's samples are read, and its body runs, under the global RNG seeded for it."""
        if step < 0:
            raise ValueError(f"a step is a count of steps done, not {step}")
        self._step = step
        self._pending = set(self.owned)
        for p in self._params:
            p.grad = None
        cuda = self.device.type == "cuda"
        devices = [self.device.index] if cuda else []
        for index in self.owned:
            with torch.random.fork_rng(devices=devices, device_type="cuda" if cuda else None):
                seed = derive_seed("rng", self.seed, step, index)
                torch.default_generator.manual_seed(seed)
                if cuda:
                    with torch.cuda.device(self.device):
                        torch.cuda.manual_seed(seed)
                samples = [self.dataset[i] for i in self.indices(step, index)]
                batch = _to(self._collate(samples), self.device)
                g = torch.Generator(device=self.device)
                g.manual_seed(derive_seed("generator", self.seed, step, index))
                yield Shard(self, step, index, batch, g)

    def sync(self) -> float:
        """Once every shard of this rank's has had its backward: gather every rank's shards,
        sum them in shard order, and put the mean gradient into each parameter's `.grad`
        (the same bits on every rank, at any group size). Returns the mean of the shards'
        losses. One collective: every rank must call it at every step."""
        if self._step is None:
            raise RuntimeError("sync() before shards(step): nothing was computed")
        if self._pending:
            raise RuntimeError(
                f"sync() at step {self._step} before shards {sorted(self._pending)} of this"
                f" rank's {list(self.owned)} had their backward: call shard.backward(loss) on"
                " every shard that shards(step) yields"
            )
        self._step = None
        if self.world_size > 1:
            dist.all_gather(self._gathered, self._send, group=self._group)
        total = self._row(0).clone()
        for shard in range(1, self.num_shards):
            total += self._row(shard)  # one add at a time, always in this order
        total /= self.num_shards
        offset = 0
        for p in self._params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p)
            offset += n
        return float(total[self._size])

    # -- internals -----------------------------------------------------------------------

    def _first(self, rank: int) -> int:
        return rank * self.num_shards // self.world_size

    def _row(self, shard: int) -> Tensor:
        owner = self.owner(shard)
        return self._gathered[owner][shard - self._first(owner)]

    def _backward(self, shard: Shard, loss: Tensor) -> None:
        if shard._step != self._step or shard.index not in self._pending:
            raise RuntimeError(
                f"shard {shard.index} of step {shard._step} was backwarded already, or its"
                " step is over"
            )
        if loss.numel() != 1:
            raise ValueError(f"a shard's loss is a scalar, not of shape {tuple(loss.shape)}")
        torch.autograd.backward(loss)
        row = self._send[shard.index - self._first(self.rank)]
        offset = 0
        for p in self._params:
            n = p.numel()
            if p.grad is None:
                row[offset : offset + n].zero_()
            else:
                row[offset : offset + n].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += n
        row[self._size] = loss.detach().reshape(())
        self._pending.discard(shard.index)


def _to(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (tensors in dicts, lists and tuples)."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_to(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to(v, device) for v in batch)
    return batch
