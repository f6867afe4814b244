"""The zygote: one process imports torch, every attempt's training process is forked from
it; forked processes report their exit, die with the zygote, and a dead zygote is replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from services.trainer.child_proc import Zygote
from tests.support.stack import alive, eventually

REPO = Path(__file__).resolve().parents[3]


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


async def test_children_are_forked_from_one_zygote_and_report_how_they_ended() -> None:
    zygote = Zygote(env())
    await zygote.start()
    try:
        first, second = await zygote.fork(), await zygote.fork()
        # Both from the same process, which imported torch once for both.
        assert zygote._proc is not None
        assert parent_of(first.pid) == parent_of(second.pid) == zygote._proc.pid
        first.kill()
        assert await first.wait() == -signal.SIGKILL and first.returncode == -signal.SIGKILL
        # A child whose trainer closes its control pipe exits by itself (orphaned: 70 in
        # `services.trainer.child`), and the zygote says so.
        second._ctl.close()
        assert await second.wait() != 0
        assert alive(zygote._proc.pid), "the zygote outlives its children"
    finally:
        await zygote.stop()
    assert not alive(first.pid) and not alive(second.pid)


async def test_a_dead_zygote_takes_its_children_along_and_is_started_again() -> None:
    zygote = Zygote(env())
    await zygote.start()
    try:
        child = await zygote.fork()
        assert zygote._proc is not None
        old = zygote._proc.pid
        os.kill(old, signal.SIGKILL)
        assert await child.wait() == -signal.SIGKILL

        async def gone() -> bool:
            return not alive(child.pid)

        await eventually(gone, 10, "the child to die with its zygote")
        again = await zygote.fork()
        assert zygote._proc.pid != old and parent_of(again.pid) == zygote._proc.pid
        again.kill()
        assert await again.wait() == -signal.SIGKILL
    finally:
        await zygote.stop()


async def test_a_sigterm_to_the_whole_job_kills_neither_the_zygote_nor_its_children() -> None:
    """Slurm ending an allocation, or systemd stopping a unit's control group, signals every
    process at once: a training process must live on until its trainer has asked it for
    the checkpoint that hands its run over."""
    zygote = Zygote(env())
    await zygote.start()
    try:
        child = await zygote.fork()
        assert zygote._proc is not None
        first = zygote._proc.pid
        os.kill(first, signal.SIGTERM)
        os.kill(child.pid, signal.SIGTERM)
        again = await zygote.fork()
        assert zygote._proc.pid == first, "the same zygote forked again: it lived on"
        # The child leaves only when its trainer lets go of it (its control pipe closed
        # before any launch: an error, 1) — neither of the signal nor of its zygote's death.
        child._ctl.close()
        assert await child.wait() == 1
        again.kill()
        assert await again.wait() == -signal.SIGKILL
    finally:
        await zygote.stop()
