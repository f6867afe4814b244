"""What a checkpoint records of the software that wrote it, and how a resume words what
changed (`baton.runtime.compat`); end to end, a deterministic run refused and then allowed:
tests/e2e/test_guards.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import baton
from baton.runtime import compat


def test_it_records_torch_python_baton_and_the_entry_points_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "userjob.py").write_text("def train(ctx):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    now = compat.recorded("userjob:train")
    assert now["torch"] == torch.__version__ and now["baton"] == baton.__version__
    assert now["python"] == sys.version.split()[0]
    assert len(now["code"]) == 16, now
    assert compat.code_digest("no.such.module:train") == ""


def test_what_changed_is_said_field_by_field_and_what_was_not_recorded_is_not_compared() -> None:
    now = {"torch": "2.6.0", "python": "3.11.7", "baton": "0.2.0", "code": "b" * 16}
    same = dict(now)
    assert compat.changes(same, now) == []
    saved = {"torch": "2.5.1", "python": "3.11.7", "code": "a" * 16}  # no baton recorded
    assert compat.changes(saved, now) == [
        "torch 2.5.1 -> 2.6.0",
        f"the entry point's code ({'a' * 16} -> {'b' * 16})",
    ]
    assert compat.changes({}, now) == [], "a checkpoint from before anything was recorded"
    assert compat.changes({"code": ""}, now) == [], "code that could not be read then"
