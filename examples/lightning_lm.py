"""A Lightning script under Baton: a small causal transformer learns to continue the text
in `data/corpus.txt`, character by character.

Written the way Lightning users write one — a `LightningModule` (dropout, AdamW, a warm-up
and cosine LR schedule stepped every optimizer step, `self.log`), a `LightningDataModule`
(a train/validation split of character windows, torchdata's `StatefulDataLoader` so that
Lightning's checkpoint holds the position in the epoch), `L.seed_everything` and
`L.Trainer(...).fit(...)` — plus the three lines of `baton.integrations.lightning`: the
callback, the Trainer's keyword arguments, and the checkpoint `fit` resumes from. The same
script runs on one rank and on several (Lightning's DDP on Baton's process group).

Why the data loaders are `StatefulDataLoader`s without a `generator=`: the training
loader's shuffle then draws from a generator of its sampler's own, whose state the loader's
`state_dict()` holds, so Lightning's checkpoint resumes the epoch mid-way in the same order;
a `generator=` given to the loader also draws every epoch's base seed, which that state does
not cover (`baton.runtime.data` says how). On several ranks Lightning replaces the shuffle
with its `DistributedSampler`, whose order comes from (seed, epoch).

Config (all optional): `window` (characters per sample), `stride` (a window starts every
`stride` characters), `batch` (per rank), `dim`, `heads`, `layers`, `dropout`, `lr`,
`weight_decay`, `warmup` (steps), `clip`, `val_every` (steps between validations; 0: none),
`val_batches`, `num_workers`, `steps_sleep` (seconds to sleep after each step, so a test can
act mid-run), `corpus` (a text file to learn instead of the bundled one), `logger` (true:
Lightning's default logger) and `log_every` (its `log_every_n_steps`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from baton import RunContext
from baton.integrations.lightning import BatonCallback

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
Sample = tuple[Tensor, Tensor]


class CharWindows(Dataset[Sample]):
    """(input, target) windows of `window` characters, the target shifted by one."""

    def __init__(self, text: str, window: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.window, self.stride = window, stride

    def __len__(self) -> int:
        return (len(self.data) - self.window - 1) // self.stride + 1

    def __getitem__(self, i: int) -> Sample:
        chunk = self.data[i * self.stride : i * self.stride + self.window + 1]
        return chunk[:-1], chunk[1:]


class CharData(L.LightningDataModule):
    def __init__(
        self,
        corpus: str = str(CORPUS),
        window: int = 64,
        stride: int = 8,
        batch: int = 16,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        text = Path(corpus).read_text(encoding="utf-8")
        self.windows = CharWindows(text, window, stride)
        self.vocab = len(self.windows.vocab)

    def setup(self, stage: str) -> None:
        # The last tenth of the text is held out: a split by position, drawing nothing.
        cut = len(self.windows) * 9 // 10
        self.train_set = Subset(self.windows, range(cut))
        self.val_set = Subset(self.windows, range(cut, len(self.windows)))

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(
            self.train_set,
            batch_size=self.hparams["batch"],
            shuffle=True,
            num_workers=self.hparams["num_workers"],
        )

    def val_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.val_set, batch_size=self.hparams["batch"])


class CharTransformer(L.LightningModule):
    def __init__(
        self,
        vocab: int,
        window: int = 64,
        dim: int = 32,
        heads: int = 2,
        layers: int = 2,
        dropout: float = 0.1,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup: int = 10,
        total_steps: int = 1000,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(window, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(window))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        h = self.drop(self.embed(x) + self.position(torch.arange(n, device=x.device)))
        causal = self.get_buffer("causal")[:n, :n]
        h = self.blocks(h, mask=causal, is_causal=True)
        return self.head(h)  # type: ignore[no-any-return]

    def _loss(self, batch: Sample) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Sample, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Sample, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])

        def schedule(step: int) -> float:
            warmup, total = int(hp["warmup"]), int(hp["total_steps"])
            if step < warmup:
                return (step + 1) / warmup
            left = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, left)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Pace(Callback):
    """Sleeps after every training step: a human pace, or time for a test to act."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def train(ctx: RunContext) -> None:
    cfg: dict[str, Any] = ctx.config
    baton = BatonCallback(ctx)  # Baton's line 1 of 3
    L.seed_everything(ctx.seed, verbose=False)

    window = int(cfg.get("window", 64))
    data = CharData(
        corpus=str(cfg.get("corpus", CORPUS)),
        window=window,
        stride=int(cfg.get("stride", 8)),
        batch=int(cfg.get("batch", 16)),
        num_workers=int(cfg.get("num_workers", 0)),
    )
    model = CharTransformer(
        data.vocab,
        window=window,
        dim=int(cfg.get("dim", 32)),
        heads=int(cfg.get("heads", 2)),
        layers=int(cfg.get("layers", 2)),
        dropout=float(cfg.get("dropout", 0.1)),
        lr=float(cfg.get("lr", 3e-3)),
        weight_decay=float(cfg.get("weight_decay", 0.01)),
        warmup=int(cfg.get("warmup", 10)),
        total_steps=ctx.total_steps,
    )
    val_every = int(cfg.get("val_every", 0))
    validation: dict[str, Any] = {"limit_val_batches": 0}
    if val_every:
        validation = {
            "val_check_interval": val_every,
            "check_val_every_n_epoch": None,
            "limit_val_batches": int(cfg.get("val_batches", 4)),
        }
    pace = float(cfg.get("steps_sleep", 0))
    trainer = L.Trainer(
        **baton.trainer_kwargs(  # 2: max_steps, the callback, the device, DDP on several ranks
            callbacks=[Pace(pace)] if pace else [],
            gradient_clip_val=float(cfg.get("clip", 1.0)),
            # Baton records the metrics; `logger: true` also gives Lightning's own logger,
            # on the run's tracker run under [tracking] tensorboard (docs/tracking.md).
            logger=bool(cfg.get("logger", False)),
            log_every_n_steps=int(cfg.get("log_every", 50)),
            enable_model_summary=False,
            **validation,
        )
    )
    trainer.fit(model, datamodule=data, ckpt_path=baton.ckpt_path())  # 3: from the newest commit
