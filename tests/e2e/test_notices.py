"""A cloud's notice that a machine is going, end to end: trainers under `baton up`'s
default authorization, each watching the metadata server of its own cloud (GCE, AWS,
Azure), answered from loopback (`tests/support/metadata.py`).

One run of the character model (its data loader keeps its position across a resume) moves
across the three clouds' machines as each announces a reclaim: every notice makes the
attempt checkpoint at once and hand the run over, the next trainer resumes at that very
step, and the run ends with the uninterrupted run's weights. Each announced machine stays
up, drained: it takes no work again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.contracts import JobSpec, RunState
from shared.contracts.events import CheckpointCommitted, Preempted, Progress, Restored
from shared.state.workers import live_workers
from tests.e2e import jobs
from tests.e2e.jobs import EventLog, finished, submit
from tests.support.metadata import MetadataServer
from tests.support.stack import Stack

pytestmark = [pytest.mark.timeout(300)]

HUB = ("dispatcher", "checkpointer", "reaper")


def charlm(total: int, pace: float) -> JobSpec:
    return jobs.charlm(total, pace, name="charlm-notice", seed=29, every=50)


def watching(meta: MetadataServer, cloud: str) -> dict[str, str]:
    return {"BATON_CLOUD": cloud, "BATON_METADATA_URL": meta.url(cloud), "BATON_NOTICE_POLL": "0.2"}


async def test_a_reclaim_notice_from_each_cloud_hands_the_run_over_at_its_step(
    tmp_path: Path,
) -> None:
    with MetadataServer() as meta:
        stack = Stack(tmp_path, trainers=0)
        await stack.start(HUB)
        try:
            nc = await stack.client()
            await stack.add_trainer("t-gce", watching(meta, "gce"))
            reference = await submit(nc, charlm(120, pace=0.0))
            want = (await finished(nc, reference, timeout=120)).digest
            run_id = await submit(nc, charlm(120, pace=0.05))
            log = EventLog(nc, run_id)
            holder, step = "t-gce", 0
            for cloud, successor, env in (
                ("gce", "t-aws", watching(meta, "aws")),
                ("aws", "t-azure", watching(meta, "azure")),
                ("azure", "t-plain", {}),
            ):
                await log.wait_for(
                    lambda e, w=holder, s=step: isinstance(e, Progress) and e.worker == w
                    and e.step > s + 5,
                    90, f"{holder} training",
                )  # fmt: skip
                meta.announce(cloud, "reclaim")
                pre = await log.wait_for(
                    lambda e, w=holder: isinstance(e, Preempted) and e.worker == w, 30,
                    f"{cloud}'s notice to hand the run over",
                )  # fmt: skip
                assert isinstance(pre, Preempted) and pre.step > step, pre
                assert pre.reason.startswith(f"drained: {cloud} reclaim notice"), pre
                # Checkpointed at the step it stopped at, not an earlier one.
                assert any(
                    isinstance(e, CheckpointCommitted) and e.step == pre.step for e in log.events
                ), log.events
                await stack.add_trainer(successor, env)
                back = await log.wait_for(
                    lambda e, w=successor: isinstance(e, Restored) and e.worker == w, 60,
                    f"{successor} to resume",
                )  # fmt: skip
                assert isinstance(back, Restored) and back.step == pre.step, (back, pre)
                holder, step = successor, pre.step
            record = await finished(nc, run_id, timeout=120)
            assert record.state is RunState.COMPLETED and record.digest == want, record
            assert record.retries == 0, record
            drained = {w.worker: w.drained for w in await live_workers(nc.jetstream())}
            assert drained == {
                "t-gce": True, "t-aws": True, "t-azure": True, "t-plain": False
            }, drained  # fmt: skip
            for name in ("t-gce", "t-aws", "t-azure"):
                assert "reclaim notice" in stack.log(name), name
            log.close()
        finally:
            await stack.stop()

