"""A small transformer language model sharded with FSDP2 (`fully_shard`): each rank holds a
part of every parameter and of AdamW's state, never the whole, and so does every checkpoint
rank writes (`baton.runtime.shards`). It resumes at the size it was saved at, bit for bit,
and, as an elastic run (`ranks = {min, max}`), at another size, each rank reading only the
rows it owns now.

Written the way an FSDP2 script is usually written, against the public `RunContext` API
only: blocks sharded one by one and then the root, AdamW, a cosine schedule, gradient
clipping. The text is `data/corpus.txt`, read character by character; every step's global
batch of windows is drawn from the step alone (a generator seeded by the run's seed and the
step) and split evenly among the ranks, so the data position needs no registering and
means the same at any group size. The reported `loss` is the mean over the global batch, the
same on every rank.

Config (all optional): `layers`, `dim`, `heads`, `window`, `batch` (the global batch: a
multiple of every group size the run may take), `lr`, `weight_decay`, `clip`, `pace`
(seconds to sleep per step, so a test can act mid-run), `corpus`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from baton import RunContext

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, window: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(window, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.norm(x))
        return logits


def shard(model: LM, ctx: RunContext) -> None:
    """FSDP2 over the group: each block, then the root (embeddings, final norm, head)."""
    if ctx.world_size == 1 and not dist.is_initialized():  # a run of one rank has no group
        from torch._C._distributed_c10d import HashStore

        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch_of(data: Tensor, step: int, seed: int, size: int, window: int) -> tuple[Tensor, Tensor]:
    """The step's global batch: `size` windows at offsets drawn from (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - window - 1, (size,), generator=g)
    rows = torch.stack([data[s : s + window + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


class Setup(NamedTuple):
    model: LM
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: Tensor
    vocab: int


def setup(ctx: RunContext) -> Setup:
    """The model, sharded over the group, its optimizer and schedule, and the text."""
    cfg: dict[str, Any] = ctx.config
    text = Path(cfg.get("corpus", CORPUS)).read_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank, before sharding
    model = LM(len(vocab), int(cfg.get("dim", 64)), int(cfg.get("layers", 2)),
               int(cfg.get("heads", 4)), int(cfg.get("window", 32))).to(ctx.device)  # fmt: skip
    shard(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 3e-3)),
                            weight_decay=float(cfg.get("weight_decay", 0.01)))  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, ctx.total_steps) / ctx.total_steps))
    )
    return Setup(model, opt, sched, data, len(vocab))


def train_step(run: Setup, ctx: RunContext, step: int) -> float:
    """One optimizer step on this rank's share of the step's global batch; the global
    batch's mean loss."""
    cfg: dict[str, Any] = ctx.config
    window, size = int(cfg.get("window", 32)), int(cfg.get("batch", 12))
    if size % ctx.world_size:
        raise ValueError(f"batch {size} cannot be split evenly among {ctx.world_size} ranks")
    share = size // ctx.world_size
    x, y = batch_of(run.data, step, ctx.seed, size, window)
    mine = slice(ctx.rank * share, (ctx.rank + 1) * share)
    logits = run.model(x[mine].to(ctx.device))
    loss = F.cross_entropy(logits.reshape(-1, run.vocab), y[mine].reshape(-1).to(ctx.device))
    loss.backward()  # type: ignore[no-untyped-call]  # FSDP2's reduce-scatter averages the ranks' gradients
    nn.utils.clip_grad_norm_(run.model.parameters(), float(cfg.get("clip", 1.0)))
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()
    total = loss.detach().clone()
    if ctx.world_size > 1:
        dist.all_reduce(total)
    return total.item() / ctx.world_size


def train(ctx: RunContext) -> None:
    run = setup(ctx)
    ctx.restore(model=run.model, optimizer=run.opt, scheduler=run.sched)
    pause = float(ctx.config.get("pace", 0))
    for step in ctx.steps():
        ctx.report(loss=train_step(run, ctx, step))
        if pause:
            time.sleep(pause)
