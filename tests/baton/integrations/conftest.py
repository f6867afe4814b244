"""The frameworks' tests are a tier of their own (`frameworks`): each imports a large
framework and trains it on a real stack, minutes in all, so `scripts/test.sh` leaves them
out and `scripts/test.sh -m frameworks` (CI, after the rest) runs them. What guards the
default install — nothing but an entry point imports a framework — stays in the default
suite."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEFAULT = {"test_imports.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if path.parent == HERE and path.name not in DEFAULT:
            item.add_marker(pytest.mark.frameworks)
