"""The ranks of one run as real training processes, forked by a real zygote as a trainer
forks them, with the test playing both the trainers (launching rank 0, then the others on
the port rank 0 reports) and the checkpointer (committing rank 0's `CheckpointReady`
messages with the real protocol, on a file store)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.trainer.child_proc import Child, Zygote
from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, JobSpec, Task
from shared.contracts.child import CheckpointReady, FromChild, Launch, Listening, Rendezvous

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60  # a bound on every wait: a hang fails the test instead of stalling the suite


class Rank:
    """One rank's training process: what it sent, and what it printed."""

    def __init__(self, child: Child, log: Path) -> None:
        self.child = child
        self.log = log
        self.sent: list[FromChild] = []
        self.news = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._read()),
            asyncio.create_task(child.copy_output(log)),
        ]

    async def _read(self) -> None:
        async for msg in self.child.messages():
            self.sent.append(msg)
            self.news.set()

    async def until(self, what: type[Any], check: Any = lambda m: True) -> Any:
        async def found() -> Any:
            while True:
                for msg in self.sent:
                    if isinstance(msg, what) and check(msg):
                        return msg
                self.news.clear()
                await self.news.wait()

        return await asyncio.wait_for(found(), WAIT_S)

    async def exit_code(self) -> int:
        code = await asyncio.wait_for(self.child.wait(), WAIT_S)
        await asyncio.wait_for(asyncio.gather(*self._tasks), WAIT_S)
        return code

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Group:
    """Two ranks of one run, on one file store."""

    def __init__(self, root: Path, zygote: Zygote, run_id: str, spec: JobSpec) -> None:
        self.size = 2
        self.root = root
        self.zygote = zygote
        self.task = Task(run_id=run_id, spec=spec)
        self.store = FileStore(root / "store")
        self.epoch = 0

    async def start(self, size: int = 2) -> list[Rank]:
        """One attempt: a new epoch (a higher token), rank 0 first, then the others at its
        port."""
        self.epoch += 1
        self.size = size
        ranks = [await self._fork(r) for r in range(size)]
        ranks[0].child.send(self._launch(0, 0))
        listening = await ranks[0].until(Listening)
        for r in range(1, size):
            ranks[r].child.send(self._launch(r, listening.port))
        return ranks

    async def _fork(self, rank: int) -> Rank:
        return Rank(await self.zygote.fork(), self.root / f"e{self.epoch}-rank{rank}.log")

    def _launch(self, rank: int, port: int) -> Launch:
        rdv = Rendezvous(epoch=self.epoch, rank=rank, world_size=self.size, addr="127.0.0.1",
                         port=port, timeout_s=self.task.spec.collective_timeout_s)  # fmt: skip
        return Launch(task=self.task, token=self.epoch, worker=f"w{rank}",
                      store_url=self.store.url, group=rdv)  # fmt: skip

    async def commit(self, leader: Rank) -> None:
        """What the checkpointer does with rank 0's checkpoints, in order."""
        for ready in leader.of(CheckpointReady):
            req = CommitRequest(
                run_id=self.task.run_id, token=ready.token, step=ready.step, worker="w0",
                files=ready.files, final=ready.final, metrics=ready.metrics,
                digest=ready.digest, sharded=ready.sharded,
                ranks=ready.ranks if self.task.spec.elastic else self.size,
            )  # fmt: skip
            await commit.commit(self.store, req)


@contextlib.asynccontextmanager
async def started(root: Path, **env: str) -> AsyncIterator[Zygote]:
    """A zygote forking every rank's process, as a trainer does (the ranks of a host share
    its spool), with `env` besides the test's own; stopped however the test ends."""
    zygote = Zygote({**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
                     "BATON_SPOOL": str(root / "spool"), **env})  # fmt: skip
    await zygote.start()
    try:
        yield zygote
    finally:
        await zygote.stop()


@pytest.fixture
async def zygote(tmp_path: Path) -> AsyncIterator[Zygote]:
    async with started(tmp_path) as z:
        yield z
