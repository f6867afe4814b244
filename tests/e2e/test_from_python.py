"""Baton from Python against a real stack: examples/from_python.py run as a user runs it
(submit, watch to the end through a pause and a resume, pull the checkpoint, compare its
digest with an uninterrupted run's), a rejected submission raising its typed error with
the dispatcher's reason, and a cancel through the async client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from baton.client.api import AsyncClient
from baton.client.errors import SubmissionRejected
from shared.contracts import RunState
from shared.contracts.events import Progress
from tests.e2e.jobs import paced
from tests.support.stack import Stack

# Pause, resume and cancel are operators' controls; both tests take ~25 s on one stack.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.operations,
    pytest.mark.asyncio(loop_scope="module"),
]
REPO = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    async with Stack(tmp_path_factory.mktemp("python") / "stack", trainers=1) as s:
        yield s


def operator_env(stack: Stack) -> dict[str, str]:
    """How a user's program finds the stack: as the CLI does, from the environment."""
    from baton.stack.options import operator_options

    creds = operator_options(stack.opts)
    return {
        "NATS_URL": stack.hub.url,
        "NATS_USER": creds["user"],
        "NATS_PASSWORD": creds["password"],
        "BATON_STORE": stack.store_url,
    }


async def test_a_rejected_submission_raises_its_reason_and_a_cancel_stops_the_run(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in operator_env(stack).items():
        monkeypatch.setenv(name, value)
    spec = paced(10_000, pace=0.03, idempotency_key="from-python")
    async with AsyncClient() as baton:
        run = await baton.submit(spec)
        assert run.answer is not None
        assert (await baton.submit(spec)).run_id == run.run_id, "one key, one run"
        with pytest.raises(SubmissionRejected) as rejected:
            await baton.submit(paced(20), replica=0)  # valid here, refused by the dispatcher
        assert rejected.value.reason.startswith("replica is set by the dispatcher")
        assert rejected.value.path == "$.replica" and rejected.value.code == 2
        assert str(rejected.value) == f"rejected: {rejected.value.reason} (at $.replica)"

        async with contextlib.aclosing(run.watch()) as events:
            async for event in events:
                if isinstance(event, Progress) and event.step >= 5:
                    break
        record = await run.cancel("changed my mind")
        assert record.state is RunState.CANCELLED and record.reason == "changed my mind"
        assert run.run_id in {r.run_id for r in await baton.runs()}


async def test_the_python_example_resumes_exactly(stack: Stack, tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "examples" / "from_python.py"), cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path),
             **operator_env(stack)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out = (await asyncio.wait_for(proc.communicate(), 200))[0].decode()
    assert proc.returncode == 0, out
    assert "pausing: PAUSED" in out and "paused; resuming:" in out, out
    assert "identical: the pause and resume cost no bit" in out, out
