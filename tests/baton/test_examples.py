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


def test_the_python_notebook_holds_the_python_examples_cells() -> None:
    """examples/from_python.ipynb is examples/from_python.py cell for cell (`# %%`), so
    running the script (tests/e2e/test_from_python.py) runs the notebook's code too."""
    import ast
    import json

    script = (EXAMPLES[0].parent / "from_python.py").read_text()
    notebook = json.loads((EXAMPLES[0].parent / "from_python.ipynb").read_text())
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert ["".join(c["source"]) for c in cells] == [
        part.strip("\n") for part in script.split("# %%\n")[1:]
    ]
    assert all(not c["outputs"] for c in cells), "the notebook is kept without outputs"
    intro = "".join(notebook["cells"][0]["source"])
    assert intro == ast.get_docstring(ast.parse(script))
