from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _every_deploy_test_cleans_up(no_leftover_processes: None) -> None:
    """Every nats-server (and openssl) a deploy test starts must be gone when it ends."""
