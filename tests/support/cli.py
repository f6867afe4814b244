"""The `baton` command run against a test's stack, as an operator runs it: its own process,
the stack's server, store and operator credentials."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.support.roles import AuthorizedHub
from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[2]


async def run_baton(*args: str, env: dict[str, str], cwd: Path = REPO) -> tuple[int, str, str]:
    """`baton ARGS` in its own process under `env`: its exit code, stdout and stderr. The
    bound is on a hang, not on speed: some commands import torch, slow on a loaded machine."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", *args, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    talk = asyncio.ensure_future(proc.communicate())
    done, _ = await asyncio.wait({talk}, timeout=180)
    if not done:
        # A hang: every thread's stack, as faulthandler writes it on SIGABRT, is the report.
        proc.send_signal(signal.SIGABRT)
        done, _ = await asyncio.wait({talk}, timeout=60)
        if not done:  # something else holds its pipes open
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            talk.cancel()
            raise AssertionError(f"baton {' '.join(args)} did not exit, nor die on SIGABRT")
        _, err = talk.result()
        raise AssertionError(
            f"baton {' '.join(args)} did not exit in 180 s; its threads:\n{err.decode()[-6000:]}"
        )
    out, err = talk.result()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def baton(stack: Stack, *args: str) -> tuple[int, str, str]:
    """Its exit code, stdout and stderr."""
    env = {
        **os.environ, "NATS_URL": stack.nats.url, "BATON_STORE": stack.store_url,
        "NATS_AUTH_FILE": str(stack.root / "auth" / "operator.env"),
    }  # fmt: skip
    return await run_baton(*args, env=env)


async def as_json(stack: Stack, *args: str) -> Any:
    """`baton <args> --json`, which must succeed: what it printed."""
    code, out, err = await baton(stack, *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def baton_as(hub: AuthorizedHub, role: str, *args: str) -> tuple[int, str, str]:
    """`baton <args>` logged in as `role` of `hub` (its credentials' file, as `baton up`
    writes them): its exit code, stdout and stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250", "NO_COLOR": "1"}
    for key in ("NATS_USER", "NATS_PASSWORD", "NATS_AUTH_FILE", "NATS_CREDS", "NATS_URL"):
        env.pop(key, None)
    hub.vault.get(role)  # its credentials' file
    auth = str(hub.root / "auth" / f"{role}.env")
    return await run_baton("--auth-file", auth, *args, "--server", hub.url, env=env, cwd=hub.root)


@contextlib.asynccontextmanager
async def authorized_hub(root: Path) -> AsyncIterator[AuthorizedHub]:
    """A hub with `baton up`'s authorization, stopped (and audited) however the test ends."""
    h = AuthorizedHub(root)
    await h.start()
    try:
        yield h
    finally:
        await h.stop()  # which fails the test on any permission refused
