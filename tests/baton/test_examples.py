"""Every example job file is a valid job whose entry point loads, as a trainer loads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.client.calls import load_spec
from services.trainer.child import load_entry_point

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_job_is_valid_and_its_entry_point_loads(path: Path) -> None:
    spec = load_spec(path)
    assert spec.deterministic, f"{path.name}: the examples show exact resume"
    assert callable(load_entry_point(spec.entry_point))


def test_there_are_examples_beyond_the_regression() -> None:
    assert {p.stem for p in EXAMPLES} >= {"job", "charlm", "cnn", "ddp", "elastic"}, EXAMPLES
