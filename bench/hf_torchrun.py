"""The Hugging Face Trainer script of examples/hf_lm.py as a torchrun worker, for
bench/frameworks.py: the same model, data and hyperparameters, plain `TrainingArguments`
with `save_steps`, resumed from the newest checkpoint in `--output-dir` when there is one
(`get_last_checkpoint`), as a Trainer script under `torchrun --max-restarts` is written.

    python -m torch.distributed.run --nproc-per-node 1 --max-restarts 1 \\
        bench/hf_torchrun.py --output-dir OUT --step-log STEPS.txt [--steps 120 --save-steps 20]

Each step appends `<time.time()> <global step> <pid>` to `--step-log` (flushed at once), so a
benchmark can tell the restarted worker's first step from the killed one's last; two more
lines mark when the script began (step -1, before its imports) and when it called
`trainer.train()` (step 0). `baton_train` is the example's `train(ctx)` with the same log,
for the run under Baton.
"""

from __future__ import annotations

import time

BEGAN = time.time()

import argparse  # noqa: E402 - after the time the script began
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

# Run as a script (torchrun's way): the repository root, for `examples`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from examples.hf_lm import CORPUS, CharWindows, Pace  # noqa: E402

# examples/hf_lm.toml's [config], `seed` and `deterministic = true`.
CONFIG: dict[str, Any] = {
    "window": 32, "stride": 8, "batch": 16, "layers": 2, "embed": 32, "heads": 2,
    "dropout": 0.1, "lr": 3e-3, "warmup": 10,
}  # fmt: skip
SEED = 42


class StepLog(TrainerCallback):
    """Appends each step's wall time, global step and this process's pid to a file."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        self.pid = os.getpid()
        self.mark(BEGAN, -1)

    def mark(self, at: float, step: int) -> None:
        self.file.write(f"{at:.6f} {step} {self.pid}\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.mark(time.time(), state.global_step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--step-log", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--pace", type=float, default=0.02)
    a = ap.parse_args()
    # As Baton's training process runs a `deterministic = true` job (services/trainer/child.py).
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    c = CONFIG
    data = CharWindows(CORPUS.read_text(), c["window"], c["stride"])
    config = GPT2Config(
        vocab_size=len(data.vocab), n_positions=c["window"], n_embd=c["embed"],
        n_layer=c["layers"], n_head=c["heads"], resid_pdrop=c["dropout"],
        embd_pdrop=c["dropout"], attn_pdrop=c["dropout"],
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        save_strategy="steps",
        save_steps=a.save_steps,
        save_total_limit=2,
        max_steps=a.steps,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=SEED,
        data_seed=SEED,
        per_device_train_batch_size=c["batch"],
        learning_rate=c["lr"],
        lr_scheduler_type="cosine",
        warmup_steps=c["warmup"],
        weight_decay=0.01,
        max_grad_norm=1.0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    log = StepLog(a.step_log)
    trainer.add_callback(log)
    if a.pace > 0:
        trainer.add_callback(Pace(a.pace))
    found = os.path.isdir(a.output_dir)
    last = get_last_checkpoint(a.output_dir) if found else None  # type: ignore[no-untyped-call]
    log.mark(time.time(), 0)
    trainer.train(resume_from_checkpoint=last)


def baton_train(ctx: Any) -> None:
    """examples/hf_lm.py's `train(ctx)` with `StepLog` added (into the job's config
    `step_log`): the entry point bench/frameworks.py runs under Baton, so both sides log their
    steps the same way. Step 0 marks `hf.fit` called."""
    from baton.integrations import hf
    from examples import hf_lm

    log = StepLog(ctx.config["step_log"])
    fit = hf.fit

    def logged(ctx: Any, trainer: Trainer) -> None:
        trainer.add_callback(log)
        log.mark(time.time(), 0)
        fit(ctx, trainer)

    hf.fit = logged
    try:
        hf_lm.train(ctx)
    finally:
        hf.fit = fit


if __name__ == "__main__":
    main()
