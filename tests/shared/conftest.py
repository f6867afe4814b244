from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.seaweed import SeaweedS3


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    """One real SeaweedFS S3 server for the session; tests isolate by key prefix."""
    with SeaweedS3() as server:
        yield server
