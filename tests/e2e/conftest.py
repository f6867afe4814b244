from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.config import Settings
from tests.support.stack import Stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    # Stopping it also waits for every training process to exit.
    async with Stack(tmp_path / "stack", trainers=1) as s:
        yield s


@pytest.fixture
async def two(tmp_path: Path) -> AsyncIterator[Stack]:
    """Two trainers, one to kill and one to take over, and `baton up`'s lease TTL: a death
    is seen by the reaper's watches (a connection closed, a pulse stopped), long before the
    lease could lapse."""
    async with Stack(tmp_path / "stack", trainers=2, lease_ttl=Settings().lease_ttl_s) as s:
        yield s
