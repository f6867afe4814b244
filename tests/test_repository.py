"""The repository reads on its own: no file cites a document that lives outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = ("NATS-NOTES", "../shared", "seeds/")
"""Names of documents outside the repository; what they taught is in docs/nats.md."""


def repository_files() -> list[str]:
    """Tracked files, and new ones git does not ignore (not yet committed)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [p for p in out.decode().split("\0") if p]


def test_no_file_cites_documents_outside_the_repository() -> None:
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = []
    for name in repository_files():
        path = ROOT / name
        if name == this or not path.is_file():
            continue
        for n, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1):
            if any(cite in line for cite in OUTSIDE):
                found.append(f"{name}:{n}: {line.strip()}")
    assert found == [], "cites a document outside the repository:\n" + "\n".join(found)
