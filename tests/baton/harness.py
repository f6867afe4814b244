"""A training child's RunContext driven in-process, with a trainer's part played by the real
commit protocol on a file store: attempts that run, 'die' (stop drawing steps), and resume.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from baton.runtime.context import RunContext
from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, Divergence, FromChild

RUN = "r1"


def spec(total: int = 12, every: int = 1, deterministic: bool = True) -> JobSpec:
    return convert(
        {
            "name": "unit",
            "entry_point": "m:f",
            "total_steps": total,
            "deterministic": deterministic,
            "checkpoint": {"every_steps": every},
        },
        JobSpec,
    )


class Attempt:
    def __init__(self, ctx: RunContext, sent: list[FromChild]) -> None:
        self.ctx = ctx
        self.sent = sent

    def checkpoints(self) -> list[CheckpointReady]:
        return [m for m in self.sent if isinstance(m, CheckpointReady)]

    def divergences(self) -> list[Divergence]:
        return [m for m in self.sent if isinstance(m, Divergence)]


class Run:
    def __init__(self, root: Path, job: JobSpec) -> None:
        self.root = root
        self.job = job
        self.store_url = f"file://{root / 'store'}"
        self.store = FileStore(root / "store")
        self.token = 0
        self.sent: list[FromChild] = []

    def attempt(
        self,
        setup: Callable[[RunContext], Callable[[int], None]],
        *,
        until: int | None = None,
        commit_upto: int | None = None,
        checkpoint_at: int | None = None,
    ) -> Attempt:
        """One attempt: `setup(ctx)` registers state and returns the body of a step; the
        attempt runs to the end, or 'dies' after step `until` (drawing no more steps). It
        checkpoints on the job's policy, and when `checkpoint_at` steps are done. Its
        checkpoints are committed up to step `commit_upto` (all by default), in order."""
        self.token += 1
        sent: list[FromChild] = []
        self.sent = sent  # what the last attempt sent, even if it raised
        ctx = RunContext(
            Task(run_id=RUN, spec=self.job), self.token, self.store_url, self.root / "spool",
            sent.append,
        )  # fmt: skip
        body = setup(ctx)
        steps: Iterator[int] = ctx.steps()
        try:
            for step in steps:
                if step == checkpoint_at:
                    ctx.checkpoint()
                body(step)
                if until is not None and step + 1 >= until:
                    break
        finally:
            ctx.close()
        attempt = Attempt(ctx, sent)
        for ready in attempt.checkpoints():
            if commit_upto is None or ready.step <= commit_upto:
                self.commit(ready)
        return attempt

    def commit(self, ready: CheckpointReady) -> None:
        req = CommitRequest(
            run_id=RUN, token=ready.token, step=ready.step, worker="w", files=ready.files,
            final=ready.final, metrics=ready.metrics, digest=ready.digest,
        )  # fmt: skip
        asyncio.run(commit.commit(self.store, req))

    def meta(self, ready: CheckpointReady) -> dict[str, Any]:
        import json

        ref = next(f for f in ready.files if f.name == "meta.json")
        loaded: dict[str, Any] = json.loads(asyncio.run(self.store.get(ref.key)))
        return loaded
