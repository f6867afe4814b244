from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from tests.shared.helpers import descendants, wait_until_sync
from tests.support.seaweed import SeaweedS3


@pytest.fixture
def no_leftover_processes() -> Iterator[None]:
    """The test must leave no process behind; stragglers are killed, then reported.
    Opt-in (`pytestmark`), because long-lived session servers legitimately outlive a test."""
    before = set(descendants())
    yield
    if wait_until_sync(lambda: not set(descendants()) - before, within=5.0):
        return
    left = sorted(set(descendants()) - before)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"processes left behind: {left}")


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    """One real SeaweedFS S3 server for the session; tests isolate by key prefix."""
    with SeaweedS3() as server:
        yield server
