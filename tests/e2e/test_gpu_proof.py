"""scripts/gpu-proof.sh --cpu --quick: the GPU proofs' code paths at tiny sizes on CPUs, as
CI runs them between lent machines (docs/gpu.md) — every proof passes, both files are
written, and nothing the script started is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import training_processes

REPO = Path(__file__).resolve().parents[2]
PROOFS = {"zygote", "exact", "framework", "cost", "overhead"}

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(660)]


def test_the_gpu_proofs_pass_on_cpus_and_write_both_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-proof.sh"), "--cpu", "--quick", "--out", str(out)],
        cwd=REPO, env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    said = done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "gpu.json").read_text())
    md = (out / "gpu.md").read_text()
    assert done.returncode == 0 and report["passed"], said + md
    assert report["mode"] == "cpu quick" and not report["leftovers"] and not report["audit"]
    assert {p["key"] for p in report["proofs"]} == PROOFS, report["proofs"]
    for proof in report["proofs"]:
        assert proof["passed"] and any(c["judged"] for c in proof["checks"]), proof
    figures = {p["key"]: p["figures"] for p in report["proofs"]}
    assert figures["exact"]["local_resumed_at_step"] > 0, figures["exact"]
    assert figures["cost"]["snapshot_copy_s"] > 0 and figures["overhead"]["ratio"] > 0
    assert md.startswith("# Baton on a CPU — passed"), md
    assert not training_processes(tmp_path), "a training process outlived the script"
    assert not list(tmp_path.glob("baton-gpu-*")), "the script's scratch is left behind"
