"""A training entry point whose module takes seconds to import, as one that imports a large
framework does: `examples.ddp`'s training, after `IMPORT_S` at import time — longer than a
test stack's group keys live (`tests/e2e/test_ranks.py`)."""

from __future__ import annotations

import time

IMPORT_S = 4.0
time.sleep(IMPORT_S)  # the import itself is slow; nothing waits on anything here

from examples.ddp import train  # noqa: E402

__all__ = ["train"]
