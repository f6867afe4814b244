"""The trainer's work directory: a lock only death releases, and the claim a successor
reads; and the lease a successor frees for its dead predecessor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client

from services.trainer.claim import CLAIM, WorkDir
from shared.contracts.tasks import Claim
from shared.errors import ConfigError
from shared.state.lease import Lease, is_held

REPO = Path(__file__).resolve().parents[3]
CLAIMED = Claim(run_id="r1", lease_key="r1.k", token=7)


def test_a_live_holder_keeps_the_directory(tmp_path: Path) -> None:
    first = WorkDir(tmp_path)
    first.lock()
    with pytest.raises(ConfigError, match="another live trainer holds the work directory"):
        WorkDir(tmp_path).lock()
    first.unlock()
    WorkDir(tmp_path).lock()


def test_a_killed_holder_leaves_the_directory_and_its_claim(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from services.trainer.claim import WorkDir\n"
            "from shared.contracts.tasks import Claim\n"
            "w = WorkDir(Path(sys.argv[1])); w.lock()\n"
            "w.hold(Claim(run_id='r1', lease_key='r1.k', token=7))\n"
            "print('holding', flush=True); time.sleep(600)\n",
            str(tmp_path),
        ],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        with pytest.raises(ConfigError):
            WorkDir(tmp_path).lock()
    finally:
        holder.kill()
        holder.wait()
    successor = WorkDir(tmp_path)
    successor.lock()  # the kernel released the dead holder's lock
    assert successor.left_behind() == CLAIMED
    successor.let_go()
    assert successor.left_behind() is None


def test_an_unreadable_claim_is_dropped(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    work.lock()
    (tmp_path / CLAIM).write_text('{"run_id": "r1"}')
    assert work.left_behind() is None
    assert not (tmp_path / CLAIM).exists()


async def test_a_successor_frees_only_its_dead_predecessors_lease(declared: Client) -> None:
    js = declared.jetstream()
    dead = Lease(js, "run1", "w1", ttl_s=60, key="k1")
    assert await dead.acquire()
    assert await dead.renew()  # the lease now names its token, not its revision
    successor = Lease(js, "run1", "w1", ttl_s=60, key="k1")
    assert not await successor.abandon(dead.token + 1), "another token is not the dead one's"
    assert await successor.abandon(dead.token)
    assert not await is_held(js, "k1")

    unrenewed = Lease(js, "run1", "w1", ttl_s=60, key="k1")
    assert await unrenewed.acquire()  # died before its first renewal
    assert await Lease(js, "run1", "w1", ttl_s=60, key="k1").abandon(unrenewed.token)
    assert not await is_held(js, "k1")

    other = Lease(js, "run1", "w2", ttl_s=60, key="k1")
    assert await other.acquire()
    assert not await Lease(js, "run1", "w1", ttl_s=60, key="k1").abandon(other.token)
    assert await is_held(js, "k1"), "another worker's lease is never freed"
