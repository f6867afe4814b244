"""A run with a tracker driven in-process: a real `RunContext` on a file store, its
checkpoints committed as the trainer would (the commit protocol itself) and the commit
told to the training side, attempts that are 'killed' at a chosen step — with or without
having heard of their last commit — and resumed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from baton.runtime.context import RunContext
from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, FromChild

RUN = "r-track"


def job(tracking: dict[str, Any], total: int = 10, every: int = 3) -> JobSpec:
    return convert(
        {
            "name": "tracked",
            "entry_point": "m:f",
            "total_steps": total,
            "checkpoint": {"every_steps": every},
            "tracking": tracking,
        },
        JobSpec,
    )


def loss(step: int) -> float:
    """What step `step` reports, the same in every attempt."""
    return 1.0 / (1 + step)


class Trainer:
    """The trainer's side of one attempt: commits what it is handed, up to `commit_upto`;
    with `hear`, tells the attempt of each commit — with `late`, only once the attempt's
    next checkpoint is handed over (a slow commit: that checkpoint holds rows written
    since)."""

    def __init__(self, store: FileStore, commit_upto: int | None, hear: bool, late: bool) -> None:
        self.store = store
        self.commit_upto = commit_upto
        self.hear = hear
        self.late = late
        self.ctx: RunContext | None = None
        self._unheard: list[int] = []

    def send(self, msg: FromChild) -> None:
        if not isinstance(msg, CheckpointReady) or self.ctx is None:
            return
        for step in self._unheard if self.hear else []:
            self.ctx.request("committed", step=step)
        self._unheard.clear()
        if self.commit_upto is not None and msg.step > self.commit_upto:
            return
        req = CommitRequest(
            run_id=RUN, token=msg.token, step=msg.step, worker="w", files=msg.files,
            final=msg.final, metrics=msg.metrics, digest=msg.digest,
        )  # fmt: skip
        asyncio.run(commit.commit(self.store, req))
        if self.late:
            self._unheard.append(msg.step)
        elif self.hear:
            self.ctx.request("committed", step=msg.step)


class Driver:
    def __init__(self, root: Path, spec: JobSpec) -> None:
        self.root = root
        self.spec = spec
        self.store = FileStore(root / "store")
        self.token = 0
        self.user_writer = False
        """Also log each step at once through `ctx.tracking.summary_writer()`."""

    def attempt(
        self,
        *,
        kill_after: int | None = None,
        commit_upto: int | None = None,
        hear: bool = True,
        late: bool = False,
    ) -> RunContext:
        """One attempt, 'killed' once `kill_after` steps are done (its checkpoints
        written, nothing closed), its trainer as `Trainer` says."""
        self.token += 1
        trainer = Trainer(self.store, commit_upto, hear, late)
        ctx = RunContext(
            Task(run_id=RUN, spec=self.spec), self.token, f"file://{self.root / 'store'}",
            self.root / "spool", trainer.send,
        )  # fmt: skip
        trainer.ctx = ctx
        ctx.restore(model=torch.nn.Linear(2, 1))
        writer = ctx.tracking.summary_writer() if self.user_writer and ctx.tracking else None
        for step in ctx.steps():
            ctx._checkpoints.wait()  # the last checkpoint handed over: one order every time
            ctx.report(loss=loss(step))
            if writer is not None:
                writer.add_scalar("user_loss", loss(step), step)
                writer.flush()
            if kill_after is not None and step + 1 >= kill_after:
                ctx._checkpoints.wait()  # what it handed over is written; then it is gone
                return ctx
        ctx.close()
        if writer is not None:
            writer.close()
        return ctx
