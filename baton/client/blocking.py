"""Baton from Python, without `await`: `Client` and `Run`, the blocking twins of
`AsyncClient` and `AsyncRun` (`baton.client.api`), for scripts and notebooks.

Invariant: every call runs on the client's own event loop, in a thread of its own, and
returns or raises exactly what the async API would. The connection lives on that loop
for the client's life, so the caller's thread may have an event loop running already (a
Jupyter kernel's) or none at all: neither is touched. The thread and its loop are anyio's
blocking portal (`anyio.from_thread.start_blocking_portal`): a daemon thread, stopped by
`close()` (or the `with` block's end).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Generator
from pathlib import Path
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from baton.client.api import AsyncClient, AsyncRun, Pulled, SpecLike
from shared.contracts import RunRecord
from shared.contracts.events import Accepted, Event

_END = object()


async def _next(events: AsyncIterator[Event]) -> object:
    """The next event, or `_END` (StopAsyncIteration does not cross the portal)."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return _END


class Run:
    """One run, by its id: what `Client.submit` returned, or `Client.run(run_id)`."""

    def __init__(self, portal: BlockingPortal, run: AsyncRun) -> None:
        self._portal, self._run = portal, run

    def __repr__(self) -> str:
        return repr(self._run)

    @property
    def run_id(self) -> str:
        return self._run.run_id

    @property
    def answer(self) -> Accepted | None:
        """The dispatcher's `Accepted` event, when the submission waited for it."""
        return self._run.answer

    def status(self) -> RunRecord:
        """The run record: its state, step, attempts, metrics, digest once completed."""
        return self._portal.call(self._run.status)

    def watch(self) -> Generator[Event, None, None]:
        """The run's events, from its first, live, up to the one that ends it."""
        events = self._run.watch()
        try:
            while (event := self._portal.call(_next, events)) is not _END:
                yield event  # type: ignore[misc]
        finally:
            with contextlib.suppress(RuntimeError):  # the client was closed first
                self._portal.call(events.aclose)

    def wait(self, timeout: float | None = None) -> RunRecord:
        """Block until the run has ended; its final record. Raises `WaitTimedOut` after
        `timeout` seconds (the run goes on)."""
        return self._portal.call(self._run.wait, timeout)

    def logs(self) -> str:
        """What the run's training processes printed so far (stdout and stderr)."""
        return self._portal.call(self._run.logs)

    def pull(self, dest: str | Path, step: int | None = None, token: int | None = None) -> Pulled:
        """Download and verify the newest committed checkpoint (or the one at `step`) into
        `dest`, as `baton pull` does."""
        return self._portal.call(self._run.pull, dest, step, token)

    def cancel(self, reason: str = "cancelled by user", wait: float = 60.0) -> RunRecord:
        """Ask for a cancel, then wait up to `wait` seconds for the run to end; its record."""
        return self._portal.call(self._run.cancel, reason, wait)

    def pause(self, reason: str = "", wait: float = 60.0) -> RunRecord:
        """Hold the run until `resume` (a running one checkpoints and stops)."""
        return self._portal.call(self._run.pause, reason, wait)

    def resume(self, reason: str = "", wait: float = 30.0) -> RunRecord:
        """Queue a paused run again, from its newest committed checkpoint."""
        return self._portal.call(self._run.resume, reason, wait)


class Client:
    """A connection to a Baton hub, found as the CLI finds it; connected when made, closed
    by `close()` or at the end of `with Client() as baton:`. Takes what `AsyncClient`
    takes."""

    def __init__(self, url: str | None = None, creds: str | None = None, **options: Any):
        self._async = AsyncClient(url, creds, **options)
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(start_blocking_portal(name="baton-client"))
        try:
            self._portal.call(self._async.connect)
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        """Close the connection and stop the client's thread; runs go on."""
        with contextlib.suppress(RuntimeError):  # closed before
            self._portal.call(self._async.close)
        self._stack.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return self._async.url

    def submit(self, spec: SpecLike, **overrides: Any) -> Run:
        """Submit a job (a `JobSpec`, a dict, or a job file's path), with top-level fields
        replaced by `overrides`; raises `SubmissionRejected` if the dispatcher refused it."""
        run = self._portal.call(lambda: self._async.submit(spec, **overrides))
        return Run(self._portal, run)

    def run(self, run_id: str) -> Run:
        """A run submitted before, by its id."""
        return Run(self._portal, self._async.run(run_id))

    def runs(self, history: bool = False) -> list[RunRecord]:
        """The records of runs not yet retired, oldest first; every run with `history`."""
        return self._portal.call(self._async.runs, history)

    def store(self) -> str:
        """The checkpoint store's URL, found as `baton pull` finds it."""
        return self._portal.call(self._async.store)
