"""Proof 5's entry point: the Hugging Face Trainer training a Llama built from a config (no
weights downloaded), bf16, on token windows — written as a Trainer script is, with the two
changes Baton asks for (`baton.integrations.hf`). Its own module: only this job imports
transformers."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from baton import RunContext
from baton.integrations import hf
from bench.gpu.models import Tokens


class Windows(Dataset[dict[str, torch.Tensor]]):
    """The proofs' token windows as the Trainer takes them (the model shifts the labels)."""

    def __init__(self, vocab: int, seq: int, windows: int, seed: int) -> None:
        self.tokens = Tokens(vocab, seq - 1, windows, seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens.data[i]
        return {"input_ids": ids, "labels": ids}


class Pace(TrainerCallback):
    """Waits `seconds` after every step (no arithmetic changes): a kill between two saves
    lands there."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._never = threading.Event()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self._never.wait(self.seconds)


def train(ctx: RunContext) -> None:
    c = ctx.config
    data = Windows(int(c["vocab"]), int(c["seq"]), int(c["windows"]), ctx.seed)
    config = LlamaConfig(
        vocab_size=int(c["vocab"]), hidden_size=int(c["hidden"]),
        intermediate_size=int(c["intermediate"]), num_hidden_layers=int(c["layers"]),
        num_attention_heads=int(c["heads"]), num_key_value_heads=int(c["heads"]),
        max_position_embeddings=int(c["seq"]),
    )  # fmt: skip
    torch.manual_seed(ctx.seed)
    model = LlamaForCausalLM(config)
    args: TrainingArguments = hf.training_arguments(
        ctx,
        per_device_train_batch_size=int(c["batch"]),
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        weight_decay=0.01,
        max_grad_norm=1.0,
        bf16=True,
        use_cpu=ctx.device.type == "cpu",
        dataloader_num_workers=1,
        dataloader_pin_memory=ctx.device.type == "cuda",
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if float(c.get("pace", 0)) > 0:
        trainer.add_callback(Pace(float(c["pace"])))
    hf.fit(ctx, trainer)
