"""The documentation holds together: the README is a front door of at most `README_LINES`
that keeps the two quickstart commands and maps every page of docs/; the command and
settings references are what `scripts/reference.py` makes of the code now (every command
of `baton` among them); and the docs site builds with `mkdocs build --strict`, every link
checked, wherever mkdocs is installed (the dev extras; CI builds it in .ci/run too)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 300
QUICKSTART = """```sh
scripts/demo.sh    # the main job on the embedded stack
scripts/test.sh    # the test suite, against real nats-server and SeaweedFS processes
```"""


def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference", ROOT / "scripts" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[str]:
    return sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    lines = len(text.splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, more than {README_LINES}"
    assert QUICKSTART in text, "README.md's quickstart commands changed"
    unmapped = [p for p in pages() if p != "index.md" and f"(docs/{p})" not in text]
    assert unmapped == [], f"README.md's map lacks {unmapped}"


def test_the_docs_index_maps_every_page() -> None:
    text = (ROOT / "docs" / "index.md").read_text()
    unmapped = [p for p in pages() if p != "index.md" and f"]({p})" not in text]
    assert unmapped == [], f"docs/index.md lacks {unmapped}"


def test_the_generated_references_are_current() -> None:
    ref = reference()
    for rel, make in ref.PAGES.items():
        assert (ROOT / rel).read_text() == make(), f"{rel} is stale: run scripts/reference.py"


def test_every_command_is_in_the_reference() -> None:
    ref = reference()
    text = (ROOT / "docs" / "cli.md").read_text()
    names = ref.commands()
    assert "baton up" in names and "baton dlq replay" in names, names
    missing = [n for n in names if f"\n## `{n}`\n" not in text]
    assert missing == [], f"docs/cli.md lacks {missing}: run scripts/reference.py"


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    said = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{said}"
