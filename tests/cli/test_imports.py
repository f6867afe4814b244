"""The CLI starts without torch: only `baton pull` (which recomputes a digest) needs it."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_imports_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "baton.cli.app", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "baton.cli.client" in imported, "the import log does not list the CLI itself"
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "torchdata", "numpy"))
    assert not heavy, f"baton --help imports {heavy[:5]}"
