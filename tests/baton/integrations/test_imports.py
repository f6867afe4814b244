"""The frameworks are optional (`pip install baton[hf]`, `[accelerate]`, `[lightning]`):
nothing but an entry point that uses one imports it — not the CLI, not a service, not a
training process running a run of Baton's own loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning")

PROBE = """
import sys
{imports}
print(",".join(sorted(m for m in {frameworks!r} if m in sys.modules)))
"""


def imported_by(*modules: str) -> list[str]:
    code = PROBE.format(
        imports="\n".join(f"import {m}" for m in modules), frameworks=FRAMEWORKS
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )  # fmt: skip
    return [m for m in out.stdout.strip().split(",") if m]


def test_the_cli_the_services_and_the_runtime_import_no_framework() -> None:
    assert imported_by(
        "baton.cli.app", "services.trainer.__main__", "services.checkpointer.__main__",
        "services.dispatcher.__main__", "services.reaper.__main__", "services.trainer.child",
        "baton.runtime.external", "baton.integrations", "baton.ui.server",
    ) == []  # fmt: skip


def test_baton_help_imports_no_framework() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['baton', '--help']\n"
        "try:\n    runpy.run_module('baton', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert "Usage" in out.stdout, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1:] in ([], [""]), out.stderr
