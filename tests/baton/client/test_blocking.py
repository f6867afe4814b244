"""The blocking Python API (`baton.Client`) called from a thread whose event loop is
running — a Jupyter kernel's situation: every call goes to the client's own loop in its
own thread and comes back with what the async API returns or raises. A real nats-server
with Baton's streams declared and no services (`tests/baton/client/runs.py`)."""

from __future__ import annotations

import threading

import pytest
from nats.aio.client import Client as Nats

import baton
from baton.stack.natsserver import NatsServer
from shared.contracts import RunState
from shared.contracts.events import Completed, Progress, Started
from tests.baton.client.runs import RUN, complete, running


def client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "baton-client"]


async def test_the_blocking_client_works_inside_a_running_event_loop(
    nats_server: NatsServer, nc: Nats
) -> None:
    runs = await running(nc)
    await complete(nc, runs)
    with baton.Client(nats_server.url, answer_s=0) as client:
        run = client.run(RUN)
        assert run.status().state is RunState.COMPLETED
        assert [type(e) for e in run.watch()] == [Started, Progress, Completed]
        assert run.wait(timeout=30).digest == "d"
        assert [r.run_id for r in client.runs()] == [RUN]
        with pytest.raises(baton.CliError, match="already COMPLETED"):
            run.cancel()
        with pytest.raises(baton.InvalidSpec, match="invalid job spec"):
            client.submit({"name": "x", "entry_point": "m:f", "total_steps": 0})
        # A watch left part way is closed on its loop.
        events = run.watch()
        assert isinstance(next(events), Started)
        events.close()
        # Not waiting for a dispatcher (none runs here): the job waits in the queue.
        queued = client.submit({"name": "q", "entry_point": "m:f", "total_steps": 3})
        assert queued.answer is None and queued.run_id.startswith("r")
        assert client_threads() == ["baton-client"]
    assert client_threads() == [], "close() stops the client's thread"


def test_the_package_exports_the_api_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys, baton; assert 'nats' not in sys.modules, 'import baton loaded NATS';"
        "from baton import AsyncClient, Client, SubmissionRejected, WaitTimedOut;"
        "assert issubclass(SubmissionRejected, baton.CliError);"
        "assert issubclass(WaitTimedOut, TimeoutError); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
