from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.stack import Stack, alive, eventually, training_processes


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(tmp_path / "stack", trainers=1)
    await s.start()
    try:
        yield s
    finally:
        await s.stop()

        # Whatever the test did, no training process may outlive it.
        async def none_left() -> bool:
            return not [p for p in training_processes() if alive(p)]

        await eventually(none_left, 10, "training processes to exit")
