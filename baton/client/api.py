"""Baton from Python, async: `AsyncClient` submits jobs and hands back `AsyncRun`s to
follow, wait for, read, pull and cancel. `baton.Client` (`baton.client.blocking`) is the
same API for code without an event loop of its own.

Invariant: the API does what the CLI does, through the same calls (`baton.client.calls`,
`watching`, `pull`, `inspect`), connected the same way (`connection`), and fails with the
same errors and messages (`baton.client.errors`): a `CliError` whatever went wrong, a
`SubmissionRejected` carrying the dispatcher's reason for a refused job. Nothing here
prints, and nothing here keeps a run alive: a client that goes away leaves its runs to
Baton.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client as Nats

from baton.client import calls, connection, steering, watching
from baton.client.errors import InvalidSpec, SubmissionRejected, WaitTimedOut, explain
from shared.contracts import JobSpec, RunRecord, convert, encode
from shared.contracts.events import Accepted, Event, Rejected
from shared.errors import ContractError

SpecLike = JobSpec | Mapping[str, Any] | str | Path
"""What `submit` takes: a spec, a dict of one, or the path of a `.toml` or `.json` job."""


class Pulled(msgspec.Struct, frozen=True):
    """A checkpoint pulled out of the store into `dir` (`Run.pull`), as `baton pull
    --json` reports it: its step, fencing token, whether it is the run's final one, where
    it lies in the run's lineage (`status`), the weights digest recomputed from the
    downloaded files, the files, and the metrics it was committed with."""

    run_id: str
    step: int
    token: int
    final: bool
    status: str
    digest: str
    files: list[str]
    dir: str
    metrics: dict[str, float] = {}


def job_spec(spec: SpecLike, overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """`spec` as a validated `JobSpec`, with top-level fields replaced by `overrides`
    (`steps=` is short for `total_steps=`). Raises `InvalidSpec` as `baton submit` would."""
    if isinstance(spec, str | Path):
        spec = calls.load_spec(Path(spec))
    data: dict[str, Any] = json.loads(encode(spec)) if isinstance(spec, JobSpec) else dict(spec)
    for key, value in (overrides or {}).items():
        data["total_steps" if key == "steps" else key] = value
    try:
        return convert(data, JobSpec)
    except ContractError as exc:
        raise InvalidSpec(f"invalid job spec: {exc}") from None


@contextlib.contextmanager
def worded(what: str) -> Iterator[None]:
    """What NATS raised when JetStream could not answer, as the CLI words it (a
    `CliError`); anything else as it was."""
    try:
        yield
    except Exception as exc:
        explained = explain(exc, what)
        if explained is None:
            raise
        raise explained from exc


class AsyncRun:
    """One run, by its id: what a submission returned, or `AsyncClient.run(run_id)`.

    `answer` is the dispatcher's `Accepted` event when the submission waited for it (None
    when it did not come in time: the job waits in the queue)."""

    def __init__(self, client: AsyncClient, run_id: str, answer: Accepted | None = None):
        self.client, self.run_id, self.answer = client, run_id, answer

    def __repr__(self) -> str:
        return f"Run({self.run_id!r})"

    async def status(self) -> RunRecord:
        """The run record: its state, step, attempts, metrics, digest once completed."""
        with worded("status"):
            return await calls.record(self.client.nc, self.run_id)

    async def watch(self) -> AsyncGenerator[Event, None]:
        """The run's events, from its first, live, up to the one that ends it. A run whose
        ending event never came ends on its terminal record (`baton.client.watching`)."""
        with worded("watch"):
            async for item in watching.until_end(self.client.nc, self.run_id, watching.QUIET_S):
                if isinstance(item, RunRecord):
                    return
                yield item

    async def wait(self, timeout: float | None = None) -> RunRecord:
        """Follow the run until it has ended; its final record. Raises `WaitTimedOut`
        after `timeout` seconds (the run goes on)."""
        try:
            async with asyncio.timeout(timeout):
                async for _ in self.watch():
                    pass
                # The record changes before the ending event is sent: it is terminal now.
                with worded("wait"):
                    return await calls.await_state(self.client.nc, self.run_id, set(), 10.0)
        except TimeoutError:
            if timeout is None:
                raise
            state = (await self.status()).state.value
            raise WaitTimedOut(self.run_id, state, timeout) from None

    async def logs(self) -> str:
        """What the run's training processes printed so far (stdout and stderr)."""
        from baton.client.inspect import log_chunks

        with worded("logs"):
            chunks = [c async for c in log_chunks(self.client.nc, self.run_id, follow=False)]
        return b"".join(chunks).decode(errors="replace")

    async def pull(
        self, dest: str | Path, step: int | None = None, token: int | None = None
    ) -> Pulled:
        """Download the run's newest committed checkpoint that verifies (or the one at
        `step`, under `token`) into `dest`, check every file, recompute the weights
        digest: `baton pull`."""
        info = await calls.pull(await self.client.store(), self.run_id, Path(dest), step, token)
        return msgspec.convert(info, Pulled)

    async def cancel(self, reason: str = "cancelled by user", wait: float = 60.0) -> RunRecord:
        """Ask for a cancel (a running run checkpoints first), then wait up to `wait`
        seconds for the run to end (0: not at all); its record then. A run already over
        raises `CliError`, as `baton cancel` does."""
        with worded("cancel"):
            await calls.cancel(self.client.nc, self.run_id, reason)
            return await calls.await_state(self.client.nc, self.run_id, {"CANCELLED"}, wait)

    async def pause(self, reason: str = "", wait: float = 60.0) -> RunRecord:
        """Hold the run (a running one checkpoints and stops) until `resume`; waits up to
        `wait` seconds for PAUSED. `baton pause`."""
        from shared.contracts.control import Pause

        req = Pause(run_id=self.run_id, reason=reason)
        with worded("pause"):
            return await steering.steer_and_await(self.client.nc, req, {"PAUSED"}, wait)

    async def resume(self, reason: str = "", wait: float = 30.0) -> RunRecord:
        """Queue a paused run again, from its newest committed checkpoint; waits up to
        `wait` seconds for it to leave PAUSED. A refusal raises `CliError` with the
        dispatcher's reason. `baton resume`."""
        from shared.contracts.control import Resume

        req = Resume(run_id=self.run_id, reason=reason)
        states = {"QUEUED", "RUNNING"}
        with worded("resume"):
            return await steering.steer_and_await(self.client.nc, req, states, wait)


class AsyncClient:
    """A connection to a Baton hub, found as the CLI finds it
    (`baton.client.connection`): `url`, else NATS_URL, else `nats://127.0.0.1:4222`;
    credentials from `creds` (a JWT creds file) or `auth_file`, else NATS_USER and
    NATS_PASSWORD, else the operator's that `baton up` wrote in ./.baton; the checkpoint
    store from `store`, else BATON_STORE, else `baton up`'s, else where the hub says.

    `async with AsyncClient() as baton: ...`, or `await connect()` and `await close()`."""

    def __init__(
        self,
        url: str | None = None,
        creds: str | None = None,
        *,
        auth_file: str | None = None,
        store: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        answer_s: float = 10.0,
    ) -> None:
        self.url = connection.server_url(url)
        self.options = connection.options(creds, auth_file, tls_ca, tls_cert, tls_key)
        self.answer_s = answer_s
        """Seconds `submit` waits for the dispatcher's answer (0: it does not wait)."""
        self._store = store
        self._nc: Nats | None = None

    @property
    def nc(self) -> Nats:
        if self._nc is None:
            raise calls.CliError("the client is not connected: use `async with` or connect()")
        return self._nc

    async def connect(self) -> AsyncClient:
        if self._nc is None:
            self._nc = await calls.open_nats(self.url, **self.options)
        return self

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            await nc.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(self, spec: SpecLike, **overrides: Any) -> AsyncRun:
        """Submit a job (a `JobSpec`, a dict, or a job file's path), with top-level fields
        replaced by `overrides` (`steps=200`, `config={...}`, `idempotency_key=...`).
        Waits up to `answer_s` for the dispatcher: raises `SubmissionRejected` with its
        reason if it refused the job. The same idempotency key submitted again is the same
        run."""
        job = job_spec(spec, overrides)
        with worded("submit"):
            run_id, answer = await calls.submit(self.nc, job, self.answer_s)
        if isinstance(answer, Rejected):
            raise SubmissionRejected(run_id, answer.reason, answer.path)
        return AsyncRun(self, run_id, answer if isinstance(answer, Accepted) else None)

    def run(self, run_id: str) -> AsyncRun:
        """A run submitted before, by its id (nothing is read until asked)."""
        return AsyncRun(self, run_id)

    async def runs(self, history: bool = False) -> list[RunRecord]:
        """The records of runs not yet retired, oldest first; every run with `history`."""
        with worded("runs"):
            return await calls.all_records(self.nc, history)

    async def store(self) -> str:
        """The checkpoint store's URL, found as `baton pull` finds it."""
        if self._store is None:
            try:
                self._store = calls.store_url(None)
            except calls.CliError:
                with worded("pull"):
                    self._store = await calls.hub_store(self.nc)
        return self._store
