"""A rank's group on gloo, two real processes on loopback (`group_rank.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 60
TIMEOUT_S = 5
"""The group's timeout: far below WAIT_S, and WAIT_S far below gloo's 30-minute default."""


def rank(r: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.baton.runtime.group_rank", str(r), str(TIMEOUT_S)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_a_peer_that_hangs_breaks_the_per_step_agreement_after_the_groups_timeout() -> None:
    """The agreement runs on a process group of its own; it must carry the job's
    `collective_timeout_s` like the default group, or a rank stuck in it waits for as long
    as gloo's default allows (30 minutes) on a peer that has stopped taking part."""
    leader, member = rank(0), rank(1)
    try:
        assert leader.stdin is not None and leader.stdout is not None
        assert member.stdin is not None and member.stdout is not None
        assert leader.stdout.readline().strip() == "ready"
        assert member.stdout.readline().strip() == "ready"
        leader.stdin.write("go\n")
        leader.stdin.flush()
        member.stdin.write(leader.stdout.readline())
        member.stdin.flush()
        assert member.stdout.readline().strip() == "joined"
        out, _ = leader.communicate(timeout=WAIT_S)
        assert leader.returncode == 3, out
        assert out.startswith("broken: True: "), out
        assert "Timed out" in out, out
    finally:
        for proc in (leader, member):
            proc.kill()
            proc.communicate()
