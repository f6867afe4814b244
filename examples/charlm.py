"""A character-level language model: a GRU learns to continue the text in `data/corpus.txt`.

Written the way such scripts usually are — a map-style `Dataset` of character windows, a
shuffling data loader, AdamW with a cosine schedule, dropout and gradient clipping — and
only against the public `RunContext` API. `config.data` picks how the position in the data
is kept across a crash, so one entry point covers the three ways a user would do it:

* `"baton"` (the default): `ctx.data_loader(...)`, which keeps its position by itself.
* `"cursor"`: a plain `torch.utils.data.DataLoader`, its epoch and offset kept in
  `ctx.cursor`; every epoch's order is rebuilt from (seed, epoch) and a resumed epoch skips
  to its offset by drawing indices from the batch sampler, without loading any sample.
* `"torchdata"`: torchdata's `StatefulDataLoader`, registered with `ctx.restore()` like the
  model, and iterated epoch after epoch with a plain `for batch in loader`.

Config (all optional): `data`, `num_workers`, `window`, `stride`, `batch`, `embed`,
`hidden`, `dropout`, `lr`, `weight_decay`, `clip`, `pace` (seconds to sleep per step),
`corpus` (a text file to learn instead of the bundled one).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from baton import RunContext

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
Batch = tuple[Tensor, Tensor]


class CharWindows(Dataset[Batch]):
    """(input, target) pairs of `window` characters, the target shifted by one, taken every
    `stride` characters of the text."""

    def __init__(self, text: str, window: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.window = window
        self.stride = stride
        if len(self.data) <= window:
            raise ValueError(f"the text has {len(self.data)} characters; a window is {window}")

    def __len__(self) -> int:
        return (len(self.data) - self.window - 1) // self.stride + 1

    def __getitem__(self, i: int) -> Batch:
        start = i * self.stride
        chunk = self.data[start : start + self.window + 1]
        return chunk[:-1], chunk[1:]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


class CharGRU(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: Tensor, h: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, h = self.gru(self.embed(x), h)
        return self.head(self.drop(out)), h


def dataset(config: dict[str, Any]) -> CharWindows:
    text = Path(config.get("corpus", CORPUS)).read_text(encoding="utf-8")
    return CharWindows(text, int(config.get("window", 32)), int(config.get("stride", 10)))


def batches_per_epoch(config: dict[str, Any]) -> int:
    """How many steps an epoch of this config's data lasts (the last batch may be short)."""
    return len(DataLoader(dataset(config), batch_size=int(config.get("batch", 16))))


def train(ctx: RunContext) -> None:
    cfg = ctx.config
    data, batch_size = str(cfg.get("data", "baton")), int(cfg.get("batch", 16))
    num_workers, pace = int(cfg.get("num_workers", 0)), float(cfg.get("pace", 0.0))
    ds = dataset(cfg)
    model = CharGRU(
        len(ds.vocab),
        int(cfg.get("embed", 16)),
        int(cfg.get("hidden", 64)),
        float(cfg.get("dropout", 0.1)),
    ).to(ctx.device)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=float(cfg.get("lr", 3e-3)),
        weight_decay=float(cfg.get("weight_decay", 0.01)),
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=ctx.total_steps)
    clip = float(cfg.get("clip", 1.0))

    def train_step(x: Tensor, y: Tensor) -> float:
        model.train()
        logits, _ = model(x.to(ctx.device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(ctx.device).flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        return loss.item()

    if data == "baton":
        batches = ctx.data_loader(ds, batch_size=batch_size, num_workers=num_workers)
        ctx.restore(model=model, optimizer=opt, scheduler=sched)
        for _step in ctx.steps():
            x, y = next(batches)
            loss = train_step(x, y)
            ctx.report(loss=loss, lr=float(sched.get_last_lr()[0]), epoch=batches.epoch)
            time.sleep(pace)
    elif data == "cursor":
        g = torch.Generator().manual_seed(ctx.seed)
        loader = DataLoader(ds, batch_size=batch_size, shuffle=True, generator=g)
        ctx.restore(model=model, optimizer=opt, scheduler=sched)
        stream = cursor_batches(ctx, loader, g)
        for _step in ctx.steps():
            x, y = next(stream)
            loss = train_step(x, y)
            ctx.report(loss=loss, lr=float(sched.get_last_lr()[0]), epoch=ctx.cursor["epoch"])
            time.sleep(pace)
    elif data == "torchdata":
        g = torch.Generator().manual_seed(ctx.seed)
        loader = StatefulDataLoader(
            ds, batch_size=batch_size, shuffle=True, generator=g, num_workers=num_workers
        )
        ctx.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
        steps = ctx.steps()
        step = next(steps, None)
        while step is not None:  # one pass per epoch
            for x, y in loader:
                loss = train_step(x, y)
                ctx.report(loss=loss, lr=float(sched.get_last_lr()[0]))
                time.sleep(pace)
                # Only now ask for the next step: a checkpoint `steps()` takes here must see
                # the loader between steps, this batch drawn and the next one not yet.
                step = next(steps, None)
                if step is None:
                    break
    else:
        raise ValueError(f"config.data must be 'baton', 'cursor' or 'torchdata', not {data!r}")

    print(f"after {ctx.step} steps: {sample(model, ds, 'The keeper ', 60, ctx.device)!r}")


class SkipBatches(Sampler[list[int]]):
    """`batches` without its first `skip` batches: how a resumed epoch gets to its offset
    by drawing indices only, never loading the samples it skips (accelerate's
    `skip_first_batches` does the same)."""

    def __init__(self, batches: BatchSampler, skip: int) -> None:
        self.batches = batches
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.batches) - self.skip, 0)


def cursor_batches(
    ctx: RunContext, loader: DataLoader[Batch], g: torch.Generator
) -> Iterator[Batch]:
    """Batches epoch after epoch, the position kept in `ctx.cursor` as (epoch, batches of
    it consumed), which every checkpoint saves."""
    cursor = ctx.cursor  # read after restore(), which puts back the saved one
    cursor.setdefault("epoch", 0)
    cursor.setdefault("offset", 0)
    assert isinstance(loader.batch_sampler, BatchSampler)
    while True:
        # The epoch's order is a function of (seed, epoch) alone, so that a resumed run can
        # draw it again: the loader draws its permutation from `g`.
        g.manual_seed(ctx.seed * 1_000_003 + cursor["epoch"])
        epoch: DataLoader[Batch] = loader
        if cursor["offset"]:
            epoch = DataLoader(
                loader.dataset,
                batch_sampler=SkipBatches(loader.batch_sampler, cursor["offset"]),
                generator=g,
                collate_fn=loader.collate_fn,
                num_workers=loader.num_workers,
            )
        for batch in epoch:
            cursor["offset"] += 1
            yield batch
        cursor["epoch"] += 1
        cursor["offset"] = 0


@torch.no_grad()
def sample(model: CharGRU, ds: CharWindows, prompt: str, n: int, device: torch.device) -> str:
    """Greedy continuation of `prompt` (characters outside the vocabulary are dropped)."""
    model.eval()
    index = {c: i for i, c in enumerate(ds.vocab)}
    ids = [index[c] for c in prompt if c in index] or [0]
    logits, h = model(torch.tensor([ids], device=device))
    out: list[int] = []
    for _ in range(n):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        logits, h = model(torch.tensor([[nxt]], device=device), h)
    return prompt + ds.decode(out)
