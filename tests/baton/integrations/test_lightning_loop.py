"""Lightning's loop under Baton without a stack: the real RunContext, writer and commit
protocol, in-process — resumes at epochs' last steps, where Lightning's own resume would run
an epoch ahead, and what a script that cannot run under Baton is told. (Apart from
test_lightning.py's stack: Lightning in this process must not share its event loop.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from baton.integrations.lightning import BatonCallback
from baton.runtime.context import RunContext
from examples.lightning_lm import CharData, CharTransformer
from services.trainer.child import _configure_torch
from shared.contracts import Task
from shared.contracts.child import CheckpointReady, Divergence, FromChild, Loaded, StepDone
from tests.baton.harness import RUN, Run, spec

pytestmark = [
    # Lightning 2.6's own use of torch's pytree API, nothing of ours.
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

class Died(Exception):
    pass


class DieAt(Callback):
    """Raises in step `at`, before Baton's step boundary: as if killed during it."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise Died(self.at)


class EpochLogged(CharTransformer):
    """The example's model, logging the epoch too: the self-check then compares it."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.log("epoch", float(self.current_epoch))
        return super().training_step(batch, batch_idx)


@pytest.fixture
def like_a_training_process() -> Iterator[None]:
    """The torch settings a deterministic run's process has (services/trainer/child.py),
    put back afterwards."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def attempt(run: Run, die_at: int | None = None, resume: bool = True) -> list[FromChild]:
    """One attempt of a Lightning script on the example's model and data; its checkpoints
    committed. `resume=False`: the script forgets `ckpt_path`."""
    run.token += 1
    sent: list[FromChild] = []
    _configure_torch(run.job.deterministic, run.job.seed)
    ctx = RunContext(
        Task(run_id=RUN, spec=run.job), run.token, run.store_url, run.root / "spool",
        sent.append,
    )  # fmt: skip
    baton = BatonCallback(ctx)
    L.seed_everything(ctx.seed, verbose=False)
    data = CharData(stride=24, batch=8)
    model = EpochLogged(data.vocab, dim=32, heads=2, warmup=5, total_steps=ctx.total_steps)
    trainer = L.Trainer(
        **baton.trainer_kwargs(
            callbacks=[DieAt(die_at)], logger=False, enable_model_summary=False,
            val_check_interval=7, check_val_every_n_epoch=None, limit_val_batches=2,
        )
    )  # fmt: skip
    try:
        trainer.fit(model, datamodule=data, ckpt_path=baton.ckpt_path() if resume else None)
    except Died:
        pass
    finally:
        ctx.close()
    for ready in sent:
        if isinstance(ready, CheckpointReady):
            run.commit(ready)
    return sent


def digest(sent: list[FromChild]) -> str:
    return [m for m in sent if isinstance(m, CheckpointReady)][-1].digest


def test_a_resume_at_an_epochs_last_step_goes_on_in_step(
    tmp_path: Path, like_a_training_process: None
) -> None:
    """An epoch is 29 steps; checkpoints every 29 fall on epochs' last steps, where
    Lightning's own resume would count an empty epoch (`BatonCallback.on_load_checkpoint`).
    Killed past each one's witness, resumed twice: the epoch each step logs, its loss and
    the final weights are the uninterrupted run's."""
    whole = attempt(Run(tmp_path / "whole", spec(total=70, every=29)))
    run = Run(tmp_path / "cut", spec(total=70, every=29))
    attempt(run, die_at=34)
    second = attempt(run, die_at=63)
    third = attempt(run)
    assert [m.step for m in second + third if isinstance(m, Loaded)] == [29, 58]
    diverged = [m for m in second + third if isinstance(m, Divergence)]
    assert not diverged, diverged
    assert digest(third) == digest(whole)
    done = [m for m in whole if isinstance(m, StepDone)]
    assert done[-1].metrics["epoch"] == 2.0 and "val_loss" in done[-1].metrics, done[-1]


def test_a_script_that_cannot_run_under_baton_is_told_why(
    tmp_path: Path, like_a_training_process: None
) -> None:
    run = Run(tmp_path, spec(total=12, every=5))
    sent: list[FromChild] = []
    ctx = RunContext(Task(run_id=RUN, spec=run.job), 1, run.store_url, tmp_path / "s", sent.append)
    baton = BatonCallback(ctx)
    with pytest.raises(ValueError, match="total_steps"):
        baton.trainer_kwargs(max_steps=5)
    with pytest.raises(ValueError, match="max_epochs"):
        baton.trainer_kwargs(max_epochs=3)
    data = CharData(stride=24, batch=8)
    trainer = L.Trainer(max_steps=12, max_epochs=1, callbacks=[baton], logger=False)
    with pytest.raises(ValueError, match=r"max_epochs=1 .*trainer_kwargs"):
        trainer.fit(CharTransformer(data.vocab, dim=16, heads=2), datamodule=data)
    ctx.close()

    attempt(run, die_at=8)  # commits step 5
    with pytest.raises(ValueError, match=r"resumes from step 5: .*ckpt_path=baton\.ckpt_path"):
        attempt(run, resume=False)
