"""What the CLI does over NATS and the store, separate from how it prints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tomllib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.errors import ConnectionClosedError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import NotFoundError, ServiceUnavailableError

from baton.client import at_site, reader
from baton.client.at_site import hub_answers as hub_answers
from baton.client.at_site import hub_domain as hub_domain
from baton.client.at_site import site_of as site_of
from baton.client.errors import CliError as CliError  # re-exported: callers catch client.CliError
from baton.client.errors import InvalidSpec, needs
from baton.client.patience import PatientClient
from baton.client.pull import pull as pull  # re-exported: callers pull with client.pull
from shared import auth
from shared.bus import names
from shared.bus.connect import connect
from shared.contracts import JobSpec, RunRecord, convert, decode, encode, run_id_for
from shared.contracts.control import CancelRequest, Rollback, Steer, WorkerInfo
from shared.contracts.events import Accepted, Diverged, Event, Rejected
from shared.errors import ContractError
from shared.state import archive
from shared.state.runs import Runs
from shared.state.workers import live_workers

CONNECT_TIMEOUT_S = 5.0


def _say_waiting(patience_s: float) -> None:
    print(
        f"waiting for JetStream to answer (a hub node restarting or electing?), up to "
        f"{patience_s:.0f} s",
        file=sys.stderr,
        flush=True,
    )


async def open_nats(
    url: str, waiting: Callable[[float], None] | None = _say_waiting, **options: Any
) -> Client:
    """Connect for one CLI command; `options` carry credentials and TLS. Its requests ride
    a hub node's election (`patience`); `waiting` says so, once."""
    try:
        return await connect(
            url,
            "baton-cli",
            first_attempt_timeout=CONNECT_TIMEOUT_S,
            options=options,
            client=PatientClient(waiting),
        )
    except ConnectionError as exc:
        raise CliError(f"{exc}. Is the stack up? Start it with `baton up`.") from None


async def wait_for_services(nc: Client, pool: str, timeout: float) -> None:
    """Wait until a dispatcher, a checkpointer and a trainer of `pool` have declared their
    durable consumers: before that, a submission would only wait in the queue."""
    js = nc.jetstream()
    wanted = [
        (names.SUBMIT_STREAM, names.DISPATCHER_CONSUMER),
        (names.CKPT_STREAM, names.CHECKPOINTER_CONSUMER),
        (names.TASKS_STREAM, names.trainer_consumer(pool)),
    ]
    deadline = asyncio.get_running_loop().time() + timeout
    for stream, consumer in wanted:
        while True:
            try:
                await js.consumer_info(stream, consumer)
                break
            except NotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise CliError(f"no {consumer} on {stream} after {timeout:.0f}s") from None
                await asyncio.sleep(0.1)


def load_spec(path: Path) -> JobSpec:
    """Read a job spec from TOML or JSON and validate it the way the dispatcher will."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidSpec(f"cannot read {path}: {exc.strerror}") from None
    try:
        data: Any = tomllib.loads(raw.decode()) if path.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSpec(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    try:
        return convert(data, JobSpec)
    except ContractError as exc:
        raise InvalidSpec(f"{path}: invalid job spec: {exc}") from None


async def submit(
    nc: Client, spec: JobSpec, wait_s: float, site: str = ""
) -> tuple[str, Event | None]:
    """Publish a spec; wait up to `wait_s` for the dispatcher's accepted/rejected event.

    At a site (`nc` connected to its leaf node) the spec goes to the site's own submit
    stream, which stores it even while the link to the hub is down; the site's dispatcher
    answers, into the site's outbox, where the answer is read (link or no link).

    The root span of the run's trace is `submit`: a new trace (never a child of whatever
    span the caller has open), since one trace is one run. Its context goes to the
    dispatcher in the submission's headers. Without `shared.telemetry.setup()` in this
    process the span is a no-op, nothing is injected, and the dispatch starts the trace."""
    from opentelemetry import trace
    from opentelemetry.context import Context

    from shared import telemetry

    key = spec.idempotency_key or uuid.uuid4().hex
    spec = convert({**json.loads(encode(spec)), "idempotency_key": key}, JobSpec)
    owner = auth.owner_of(nc.options.get("user") or "")
    run_id = run_id_for(key, owner)
    js = nc.jetstream()
    with telemetry.tracer.start_as_current_span(
        "submit",
        context=Context(),
        kind=trace.SpanKind.PRODUCER,
        attributes={telemetry.RUN_ID: run_id, telemetry.POOL: spec.pool, "baton.name": spec.name},
    ) as span:
        await js.publish(
            names.at_site(names.submit_subject(spec.pool, owner), site),
            encode(spec),
            headers=telemetry.inject({"Nats-Msg-Id": key}),
        )
        if wait_s <= 0:
            return run_id, None
        try:
            if site:  # the site's own dispatcher answers, into the site's outbox
                events = names.at_site(names.events_of_run(run_id), site)
                sub = await reader.read(nc, names.OUTBOX_STREAM, events)
            else:
                sub = await _subscribe_events(nc, run_id)
        except (ServiceUnavailableError, TimeoutError, NatsTimeoutError):
            return run_id, None
        try:
            answer: Accepted | Rejected | None = await reader.first(sub, wait_s, answer_of)
        finally:
            await sub.unsubscribe()
        if answer is not None:
            verdict = "accepted" if isinstance(answer, Accepted) else "rejected"
            span.set_attribute(telemetry.OUTCOME, verdict)
        return run_id, answer


def answer_of(msg: Any) -> Accepted | Rejected | None:
    """The dispatcher's answer to a submission, if `msg` is it (an event this version cannot
    read is not)."""
    try:
        event: Event = decode(msg.data, Event)
    except ContractError:
        return None
    return event if isinstance(event, Accepted | Rejected) else None


async def events(nc: Client, run_id: str) -> AsyncIterator[Event]:
    """Every event of a run, from its first, then live."""
    async for event in follow(nc, run_id, idle_s=3600):
        if event is not None:
            yield event


async def follow(nc: Client, run_id: str, idle_s: float) -> AsyncIterator[Event | None]:
    """Every event of a run, from its first, then live, and `None` after every `idle_s`
    without one: a follower then reads the run record, which is the truth when an event it
    waits for never comes (its writer died after the record changed, or the stream
    discarded it)."""
    sub = await _subscribe_events(nc, run_id)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except TimeoutError:
                yield None
                continue
            except ConnectionClosedError:
                return
            yield decode(msg.data, Event)
    finally:
        with contextlib.suppress(ConnectionClosedError):
            await sub.unsubscribe()


async def _subscribe_events(nc: Client, run_id: str, domain: str | None = None) -> Any:
    try:
        with needs("events stream"):
            return await reader.read(
                nc, names.EVENTS_STREAM, names.events_of_run(run_id), domain or hub_domain(nc)
            )
    except NotFoundError:
        if site_of(nc):
            raise
        raise CliError(
            f"stream {names.EVENTS_STREAM} does not exist on this server: no Baton service has"
            " started here yet (`baton up` starts them)"
        ) from None


async def history(nc: Client, run_id: str) -> list[Event]:
    """Every event of a run so far (stops at the newest; does not wait for more), each `at`
    on the hub's clock (`shared.history.clocks`): what durations are computed from."""
    from shared.history.clocks import from_messages

    sub = await _subscribe_events(nc, run_id)
    try:
        return from_messages(await reader.drain(sub))
    finally:
        await sub.unsubscribe()


async def readable_history(nc: Client, run_id: str) -> list[Event] | None:
    """As `history`; None at a site whose link does not carry the run's events for these
    credentials (a site's submitter reads its own runs' events; its operator reads only
    their records)."""
    from nats.errors import NoRespondersError

    if not (site := site_of(nc)):
        return await history(nc, run_id)
    if await at_site.site_record(nc, site, run_id) is not None:
        # A run granted to this site: its events as the site sent them, link or no link.
        from shared.history.clocks import from_messages

        sub = await reader.read(
            nc, names.OUTBOX_STREAM, names.at_site(names.events_of_run(run_id), site)
        )
        try:
            return from_messages(await reader.drain(sub))
        finally:
            await sub.unsubscribe()
    try:
        return await history(nc, run_id)
    except (NoRespondersError, NatsTimeoutError, TimeoutError, ServiceUnavailableError):
        if not await hub_answers(nc):
            raise  # cut off, not refused
        return None


async def divergences(nc: Client, run_id: str) -> list[Diverged]:
    """The run's `diverged` events: each a resume found not exact (`baton.runtime.witness`)."""
    sub = await reader.read(nc, names.EVENTS_STREAM, names.event_subject(run_id, "diverged"))
    try:
        return [decode(m.data, Diverged) for m in await reader.drain(sub, idle_s=0.2)]
    finally:
        await sub.unsubscribe()


async def record(nc: Client, run_id: str, domain: str | None = None) -> RunRecord:
    """The run's record, from the runs bucket or, once it was retired, the archive. At a
    site, the site's own record of a run granted to it first: the newest, and there with
    the link cut."""
    if (site := site_of(nc)) and domain is None:
        found = await at_site.site_record(nc, site, run_id)
        if found is not None:
            return found
    with needs("runs bucket"):
        found = await (await Runs.open(nc.jetstream(domain=domain or hub_domain(nc)))).find(run_id)
    if found is None:
        raise CliError(f"no run {run_id!r}", 3)
    return found


async def all_records(nc: Client, history: bool = False) -> list[RunRecord]:
    """The runs not yet retired (the reaper retires a run once it has been over for
    `BATON_GC_AGE`), oldest first; with `history`, every run, archived ones included.

    At a site, from the hub's runs bucket across the link, which carries that bucket but
    not the live index: what the bucket holds is the same set (the live runs and those not
    yet retired)."""
    if site := site_of(nc):
        return await at_site.site_records(nc, site, history)
    js = nc.jetstream(domain=hub_domain(nc))
    with needs("runs bucket"):
        runs = await Runs.open(js)
        if not history and site_of(nc):
            records = await runs.all()
        elif not history:
            records = [found[0] for _, found in await runs.live() if found is not None]
        else:
            with needs("archive"):
                kept = {r.run_id: r for r in await archive.records(js)}
            kept.update((r.run_id, r) for r in await runs.all())
            records = list(kept.values())
    return sorted(records, key=lambda r: r.created_at)


async def cancel(nc: Client, run_id: str, reason: str, site: str = "") -> RunRecord:
    """Ask for a cancel; the dispatcher applies it (at once for a queued run, through its
    trainer's checkpoint for a running one)."""
    found = await record(nc, run_id, names.HUB_DOMAIN if site else None)
    if found.state.terminal:
        raise CliError(f"run {run_id} is already {found.state.value}", 2)
    req = CancelRequest(run_id=run_id, reason=reason)
    await nc.jetstream().publish(
        names.at_site(names.cancel_subject(run_id), site),
        encode(req),
        headers={"Nats-Msg-Id": f"cancel.{run_id}"},
    )
    return found


async def steer(nc: Client, req: Steer) -> RunRecord:
    """Publish an operator's request about a run (`shared.contracts.control.Steer`) after
    checking the run exists and is not over (a rollback may name a failed run); the
    dispatcher carries it out, or dead-letters it with its reason. Returns the record as it
    was before."""
    found = await record(nc, req.run_id)
    if found.state.terminal and not isinstance(req, Rollback):
        raise CliError(f"run {req.run_id} is already {found.state.value}", 2)
    await nc.jetstream().publish(
        names.steer_subject(req.run_id),
        encode(req),
        headers={"Nats-Msg-Id": f"{req.action}.{req.run_id}.{uuid.uuid4().hex}"},
    )
    return found


async def await_state(nc: Client, run_id: str, wanted: set[str], wait_s: float) -> RunRecord:
    """The run's record once its state is one of `wanted` (or terminal), or as it is after
    `wait_s` seconds."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        found = await record(nc, run_id)
        if found.state.value in wanted or found.state.terminal:
            return found
        if asyncio.get_running_loop().time() >= deadline:
            return found
        await asyncio.sleep(0.2)


async def workers(nc: Client) -> list[WorkerInfo]:
    if site := site_of(nc):
        return [w for w, _ in await at_site.site_workers(nc, site)]
    with needs("workers bucket"):
        return await live_workers(nc.jetstream())


async def workers_seen(nc: Client) -> list[tuple[WorkerInfo, float]]:
    """Each live trainer with how many seconds ago the hub heard it: the server's stamp of
    its newest heartbeat against the server's clock now, never its `at` (its own clock)
    against ours."""
    from shared.state.clock import age, server_now
    from shared.state.workers import heard_workers

    if site := site_of(nc):
        return await at_site.site_workers(nc, site)
    with needs("workers bucket"):
        heard = await heard_workers(nc.jetstream())
        now = await server_now(nc, f"KV_{names.WORKERS_BUCKET}") if heard else 0.0
    return [(h.info, age(now, h.at)) for h in heard]


def store_url(explicit: str | None) -> str:
    """--store, else BATON_STORE, else the store of a `baton up` in ./.baton."""
    if explicit:
        return explicit
    if env := os.environ.get("BATON_STORE"):
        return env
    stack = Path(".baton/run/stack.json")
    if stack.exists():
        return str(json.loads(stack.read_text())["store_url"])
    raise CliError("no store given: pass --store or set BATON_STORE", 2)


async def hub_store(nc: Client) -> str:
    """The store the hub's checkpointer says it uses (`shared.state.hub`). An S3 store's
    endpoint comes with it, unless this process was given one (the store reads it from the
    environment, as every service's does)."""
    from shared.state.hub import read_store

    with needs("the hub's own facts"):
        info = await read_store(nc.jetstream())
    if info is None:
        raise CliError(
            "no store given, and the hub does not say where its store is (no checkpointer of"
            " this version has started): pass --store or set BATON_STORE",
            2,
        )
    if info.s3_endpoint and not (
        os.environ.get("BATON_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    ):
        os.environ["BATON_S3_ENDPOINT"] = info.s3_endpoint
    return info.url
