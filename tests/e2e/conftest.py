from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.stack import Stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "stack", trainers=1)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()  # which also waits for every training process to exit


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[Stack]:
    """Two trainers and a short lease: one to kill, one to take over."""
    s = Stack(tmp_path / "stack", trainers=2, lease_ttl=3)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()
