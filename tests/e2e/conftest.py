from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.stack import Stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    # Stopping it also waits for every training process to exit.
    async with Stack(tmp_path / "stack", trainers=1) as s:
        yield s


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[Stack]:
    """Two trainers and a short lease: one to kill, one to take over."""
    async with Stack(tmp_path / "stack", trainers=2, lease_ttl=3) as s:
        yield s
