from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.shared.helpers import descendants, wait_until_sync


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Every nats-server (and openssl) a deploy test starts must be gone when it ends."""
    before = set(descendants())
    yield
    if wait_until_sync(lambda: not set(descendants()) - before, within=5.0):
        return
    left = sorted(set(descendants()) - before)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"processes left behind: {left}")
