"""A small causal language model trained with Hugging Face Accelerate, under Baton.

The loop is written the way Accelerate users write one — a `transformers` model built from a
config, a shuffling `DataLoader`, AdamW with a warm-up/cosine schedule, gradient
accumulation, `accelerator.prepare(...)`, `accelerator.backward(loss)` — and the lines that
make it resumable under Baton are marked `# Baton`: the `Accelerator` comes from
`make_accelerator(ctx)`, `run.resume()` loads the newest committed checkpoint
(`accelerator.load_state`), `run.batches(loader)` draws epoch after epoch from where the run
was, and `run.step_ended(...)` at each optimizer step saves (`accelerator.save_state`) when
Baton asks and says when to stop. Nothing is downloaded: the model is a GPT-2 built from its
config, the text is `data/corpus.txt`, tokenised by hand (one id per character).

With `ranks = 2` the same code runs on two trainers, the model in DDP (Accelerate's),
each rank drawing its own share of every batch; the reported loss is the mean over ranks.

Config (all optional): `window` (characters per sample), `stride` (a sample starts every
`stride` characters), `batch` (per rank), `accumulate` (micro-batches per optimizer step),
`stateful` (the data position restored by torchdata's `StatefulDataLoader`, Accelerate's
`use_stateful_dataloader`, rather than by skipping batches), `layers`, `embed`, `heads`,
`dropout`, `lr`, `warmup` (steps), `clip`; `steps_sleep`, seconds to sleep after each
optimizer step (so a person or a test can act mid-run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DataLoaderConfiguration, set_seed  # type: ignore[import-untyped]
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, GPT2Config, get_cosine_schedule_with_warmup

from baton import RunContext
from baton.integrations.accelerate import AcceleratedRun, make_accelerator

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class CharWindows(Dataset[dict[str, Tensor]]):
    """Windows of `window` character ids, one every `stride` characters: a causal LM's
    inputs, which are its labels too (the model shifts them)."""

    def __init__(self, text: str, window: int, stride: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.window, self.stride = window, stride
        if len(self.ids) < window:
            raise ValueError(f"the text has {len(self.ids)} characters; a window is {window}")

    def __len__(self) -> int:
        return (len(self.ids) - self.window) // self.stride + 1

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        chunk = self.ids[i * self.stride : i * self.stride + self.window]
        return {"input_ids": chunk, "labels": chunk}


def train(ctx: RunContext) -> None:
    cfg: dict[str, Any] = ctx.config
    window, pause = int(cfg.get("window", 32)), float(cfg.get("steps_sleep", 0))
    accelerator = make_accelerator(  # Baton
        ctx,
        gradient_accumulation_steps=int(cfg.get("accumulate", 1)),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True,  # what make_accelerator() sets when given no config
            data_seed=ctx.seed,
            use_stateful_dataloader=bool(cfg.get("stateful", False)),
        ),
    )
    set_seed(ctx.seed)  # the same initial weights on every rank

    data = CharWindows(CORPUS.read_text(encoding="utf-8"), window, int(cfg.get("stride", 8)))
    config = GPT2Config(
        vocab_size=len(data.vocab),
        n_positions=window,
        n_embd=int(cfg.get("embed", 32)),
        n_layer=int(cfg.get("layers", 2)),
        n_head=int(cfg.get("heads", 2)),
        resid_pdrop=float(cfg.get("dropout", 0.1)),
        embd_pdrop=float(cfg.get("dropout", 0.1)),
        attn_pdrop=float(cfg.get("dropout", 0.1)),
        bos_token_id=0,
        eos_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    loader = DataLoader(data, batch_size=int(cfg.get("batch", 16)), shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 3e-3)))
    # Accelerate steps a prepared scheduler once per process at each optimizer step.
    scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(cfg.get("warmup", 10)) * accelerator.num_processes,
        num_training_steps=ctx.total_steps * accelerator.num_processes,
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    run = AcceleratedRun(ctx, accelerator, model)  # Baton
    run.resume()  # Baton: load_state() of the newest committed checkpoint, if any
    model.train()
    for batch in run.batches(loader):  # Baton: instead of `for epoch ...: for batch in loader`
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), float(cfg.get("clip", 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        lr = scheduler.get_last_lr()[0]
        if run.step_ended(loss=mean.item(), lr=lr, epoch=run.epoch).stop:  # Baton
            break
        if pause:
            time.sleep(pause)
    accelerator.print(f"after {run.step} steps: loss {mean.item():.4f}")
