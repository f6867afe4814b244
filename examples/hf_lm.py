"""A small causal language model trained with the Hugging Face `Trainer`, as a Trainer
script is usually written — a model built from a config, a `Dataset` of token windows, a
data collator, `TrainingArguments`, `Trainer(...).train()` — with the two changes Baton asks
for (`baton.integrations.hf`): the arguments come from `hf.training_arguments(ctx, ...)` and
`trainer.train()` is `hf.fit(ctx, trainer)`.

The model is a GPT-2 of a few layers built from `GPT2Config` (no weights downloaded); the
text is `data/corpus.txt`, tokenised by character (no tokenizer downloaded).

Config (all optional): `window`, `stride`, `batch`, `layers`, `embed`, `heads`, `dropout`,
`lr`, `warmup`, `workers` (data loader processes), `pace` (seconds to wait per step, so a
person or a test can act mid-run), `report_to` (the Trainer's: `"none"` unless given).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

from baton import RunContext
from baton.integrations import hf

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class CharWindows(Dataset[dict[str, torch.Tensor]]):
    """Windows of `window` characters every `stride` characters, as token ids; the model
    shifts the labels itself."""

    def __init__(self, text: str, window: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.window, self.stride = window, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.window) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        chunk = self.ids[i * self.stride : i * self.stride + self.window]
        return {"input_ids": chunk, "labels": chunk}


class Pace(TrainerCallback):
    """Waits `seconds` after every step: a human-scale run that `baton watch` can follow."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._never = threading.Event()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self._never.wait(self.seconds)


def train(ctx: RunContext) -> None:
    c = ctx.config
    data = CharWindows(CORPUS.read_text(), int(c.get("window", 32)), int(c.get("stride", 8)))
    config = GPT2Config(
        vocab_size=len(data.vocab),
        n_positions=int(c.get("window", 32)),
        n_embd=int(c.get("embed", 32)),
        n_layer=int(c.get("layers", 2)),
        n_head=int(c.get("heads", 2)),
        resid_pdrop=float(c.get("dropout", 0.1)),
        embd_pdrop=float(c.get("dropout", 0.1)),
        attn_pdrop=float(c.get("dropout", 0.1)),
    )
    torch.manual_seed(ctx.seed)
    model = GPT2LMHeadModel(config)
    args = hf.training_arguments(
        ctx,
        per_device_train_batch_size=int(c.get("batch", 16)),
        learning_rate=float(c.get("lr", 3e-3)),
        lr_scheduler_type="cosine",
        warmup_steps=int(c.get("warmup", 10)),
        weight_decay=0.01,
        max_grad_norm=1.0,
        dataloader_num_workers=int(c.get("workers", 0)),
        report_to=c.get("report_to", "none"),
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if float(c.get("pace", 0)) > 0:
        trainer.add_callback(Pace(float(c["pace"])))
    hf.fit(ctx, trainer)
