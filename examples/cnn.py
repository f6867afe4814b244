"""A small CNN classifier on synthetic images: stripes (two ways), discs and rings, in noise.

conv-bn-relu-pool twice and a linear head with dropout, SGD with Nesterov momentum and a
one-cycle learning rate, fed by `ctx.data_loader(...)` with worker processes. The images are
made on the fly by the dataset, deterministically, so nothing is downloaded. Written only
against the public `RunContext` API.

Config (all optional): `samples` (images per epoch), `batch`, `num_workers`, `width`
(channels of the first convolution), `dropout`, `noise`, `lr` (the schedule's peak),
`momentum`, `weight_decay`, `pace` (seconds to sleep per step).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from baton import RunContext

CLASSES = ("horizontal stripes", "vertical stripes", "disc", "ring")
SIDE = 28


class Shapes(Dataset[tuple[Tensor, int]]):
    """`size` noisy 28×28 grey images, each one of `CLASSES` at a random place, size, period
    and contrast; images `first`, `first + 1`, … of the endless sequence `seed` defines."""

    def __init__(self, size: int, seed: int, noise: float = 0.4, first: int = 0) -> None:
        self.size, self.seed, self.noise, self.first = size, seed, noise, first
        ys, xs = torch.meshgrid(
            torch.arange(SIDE, dtype=torch.float32),
            torch.arange(SIDE, dtype=torch.float32),
            indexing="ij",
        )
        self.ys, self.xs = ys, xs

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        # Every random choice comes from a generator seeded by (seed, index): a sample is a
        # pure function of its index. Loader workers have RNGs of their own (seeded per
        # worker and per epoch); those are not part of the loader's saved state, and which
        # worker loads which sample, after which others, changes when a run resumes
        # mid-epoch. Drawing from the global RNG here would hand a resumed run other images.
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + i)

        def uniform(lo: float, hi: float) -> float:
            return lo + (hi - lo) * float(torch.rand((), generator=g))

        label = int(torch.randint(len(CLASSES), (), generator=g))
        contrast = uniform(0.5, 1.0)
        if label < 2:  # stripes
            period, phase = uniform(3.0, 8.0), uniform(0.0, 2 * math.pi)
            axis = self.ys if label == 0 else self.xs
            img = (torch.sin(2 * math.pi * axis / period + phase) > 0).float()
        else:  # a disc, or a ring of the same outer radius
            cy, cx, r = uniform(8.0, 20.0), uniform(8.0, 20.0), uniform(4.0, 8.0)
            d = ((self.ys - cy) ** 2 + (self.xs - cx) ** 2).sqrt()
            img = (d <= r).float() if label == 2 else ((d <= r) & (d >= r - 2.0)).float()
        img = contrast * img + self.noise * torch.randn(SIDE, SIDE, generator=g)
        return ((img - 0.5) / 0.5).unsqueeze(0), label


class SmallCNN(nn.Module):
    def __init__(self, width: int, classes: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * (SIDE // 4) ** 2, classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))  # type: ignore[no-any-return]


def train_set(config: dict[str, Any], seed: int) -> Shapes:
    return Shapes(int(config.get("samples", 512)), seed, float(config.get("noise", 0.4)))


def train(ctx: RunContext) -> None:
    cfg = ctx.config
    pace = float(cfg.get("pace", 0.0))
    data = train_set(cfg, ctx.seed)
    model = SmallCNN(int(cfg.get("width", 16)), len(CLASSES), float(cfg.get("dropout", 0.25))).to(
        ctx.device
    )
    opt = torch.optim.SGD(
        model.parameters(),
        lr=float(cfg.get("lr", 0.05)),
        momentum=float(cfg.get("momentum", 0.9)),
        nesterov=True,
        weight_decay=float(cfg.get("weight_decay", 5e-4)),
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=float(cfg.get("lr", 0.05)), total_steps=ctx.total_steps
    )
    batches = ctx.data_loader(
        data,
        batch_size=int(cfg.get("batch", 32)),
        num_workers=int(cfg.get("num_workers", 0)),
        drop_last=True,
    )
    ctx.restore(model=model, optimizer=opt, scheduler=sched)

    for _step in ctx.steps():
        model.train()
        x, y = next(batches)
        x, y = x.to(ctx.device), y.to(ctx.device)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        sched.step()
        acc = (logits.argmax(1) == y).float().mean()
        ctx.report(
            loss=loss.item(), acc=acc.item(), lr=float(sched.get_last_lr()[0]), epoch=batches.epoch
        )
        time.sleep(pace)

    held_out = Shapes(256, ctx.seed, data.noise, first=len(data))
    print(f"after {ctx.step} steps: held-out accuracy {evaluate(model, held_out, ctx.device):.3f}")


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset[tuple[Tensor, int]], device: torch.device) -> float:
    model.eval()
    right = total = 0
    for x, y in DataLoader(data, batch_size=128):
        right += int((model(x.to(device)).argmax(1) == y.to(device)).sum())
        total += len(y)
    return right / max(total, 1)
