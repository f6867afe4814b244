"""The `baton` command run against a test's stack, as an operator runs it: its own process,
the stack's server, store and operator credentials."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[2]


async def baton(stack: Stack, *args: str) -> tuple[int, str, str]:
    """Its exit code, stdout and stderr."""
    env = {
        **os.environ, "NATS_URL": stack.nats.url, "BATON_STORE": stack.store_url,
        "NATS_AUTH_FILE": str(stack.root / "auth" / "operator.env"),
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", *args, cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    # A bound on a hang, not on speed: some commands import torch, slow on a loaded machine.
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def as_json(stack: Stack, *args: str) -> Any:
    """`baton <args> --json`, which must succeed: what it printed."""
    code, out, err = await baton(stack, *args, "--json")
    assert code == 0, err
    return json.loads(out)
