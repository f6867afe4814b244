"""An operator's request about a run (pause, resume, checkpoint now, roll back), sent and
waited for: `baton pause` and `baton resume`, and the Python API's `Run.pause` and
`Run.resume`.

Invariant: a wait ends at the state the request leads to, at a terminal state, at the end
of the time given — or, for a resume, at the dispatcher's refusal of this very request
(never an earlier one's), raised as a `CliError` with its reason.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from baton.client import calls, reader
from baton.client.errors import CliError, needs
from shared.bus import names
from shared.contracts import RunRecord, decode
from shared.contracts.control import Steer
from shared.contracts.events import Event, RunWarning
from shared.errors import ContractError


async def steer_and_await(nc: Client, req: Steer, states: set[str], wait: float) -> RunRecord:
    """Send `req` (`calls.steer`), then the run's record once its state is one of `states`
    (or terminal), or as it is after `wait` seconds; a resume's refusal ends the wait."""
    if req.action == "resume" and wait > 0:
        return await _resume_or_refusal(nc, req, states, wait)
    await calls.steer(nc, req)
    return await calls.await_state(nc, req.run_id, states, wait)


async def _resume_or_refusal(nc: Client, req: Steer, states: set[str], wait: float) -> RunRecord:
    """Resume, then wait as `calls.await_state` does — but the dispatcher's `warning` of
    kind `resume_refused` about the run, stored after the request was made, ends the wait
    with its reason (`CliError`, exit 1). The run's warnings are read from before the
    request is published, from the events stream's end: only a refusal of this request
    counts, never an earlier one's."""
    with needs("events stream"):
        warnings = await reader.read(
            nc, names.EVENTS_STREAM, names.event_subject(req.run_id, "warning"),
            calls.hub_domain(nc), new=True,
        )  # fmt: skip
    try:
        await calls.steer(nc, req)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            found = await calls.record(nc, req.run_id)
            if found.state.value in states or found.state.terminal:
                return found
            left = deadline - loop.time()
            if left <= 0:
                return found
            refused = await refusal(warnings, min(left, 0.2))
            if refused is not None:
                raise CliError(f"run {req.run_id}: resume refused: {refused}", 1)
    finally:
        await warnings.unsubscribe()


async def refusal(warnings: reader.StreamReader, timeout: float) -> str | None:
    """The reason of a `resume_refused` warning among those `warnings` delivers within
    `timeout` seconds, if one comes; None otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (left := deadline - loop.time()) > 0:
        try:
            msg = await warnings.next_msg(timeout=left)
        except TimeoutError:
            return None
        try:
            event = decode(msg.data, Event)
        except ContractError:
            continue  # a newer Baton's event
        if isinstance(event, RunWarning) and event.kind == "resume_refused":
            return event.detail
    return None
