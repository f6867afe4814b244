"""`baton up`: the whole stack on one machine — or one site of it.

An embedded nats-server (JetStream, loopback only), a `file://` store, and the services as
supervised child processes: dispatcher, checkpointer, reaper and N trainers. The server is
the hub (JetStream domain `hub`) and listens for sites on a WebSocket port.

With `site`, it is a site instead: a leaf nats-server in the site's own domain that dials
the hub's WebSocket, the site's checkpointer, and N trainers that take the hub's work. A site
shares the hub's store (`store`), since either may resume the other's runs.

Everything lives under one data directory:

    <data>/nats   server config, log and JetStream store
    <data>/store  checkpoints (the `file://` object store)
    <data>/logs   one log per service
    <data>/run    pid files, `stack.json` (present while the stack runs), `stack.lock`
    <data>/work   per-trainer scratch
    <data>/auth   generated NATS credentials, one owner-only file per user
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import IO, Any

import msgspec

from baton.stack.authority import catch_up, on_sighup, with_people
from baton.stack.children import install_stop_signals, remove_stop_signals
from baton.stack.cluster import HubCluster
from baton.stack.natsserver import NatsServerError
from baton.stack.options import (
    StackOptions,
    admits_machines,
    devices,
    operator_options,
    store_url,
    vault,
)
from baton.stack.procs import ServiceSpec, Supervisor
from baton.stack.servers import hub
from baton.stack.services import SpecBuilder, service_specs, stop_order
from shared.bus import names

log = logging.getLogger("baton.stack")

# The server must outlive every service's shutdown (trainers commit through it), so it only
# gets its own, short, grace once they are all gone.
NATS_STOP_TIMEOUT_S = 10.0

# A crash-looping server gets the same patience as a crash-looping service.
NATS_RESTART_DELAY_S = 1.0


async def run_stack(
    opts: StackOptions,
    *,
    stop: asyncio.Event | None = None,
    hurry: asyncio.Event | None = None,
    build_specs: SpecBuilder = service_specs,
    out: IO[str] | None = None,
    reload: asyncio.Event | None = None,
) -> int:
    """Run the stack until SIGINT/SIGTERM, or until `stop` is set when one is given (then no
    signal handlers are installed, `hurry` plays the second signal and `reload` SIGHUP). A
    second signal skips the grace periods. SIGHUP reloads the people (`reload_people`).
    Returns the exit status for the CLI: 0 after a clean stop, 1 when the stack could not
    start or lost its NATS server for good."""
    out = out if out is not None else sys.stdout
    # Ask nvidia-smi once: the trainers' specs and the banner both need the GPUs.
    opts = msgspec.structs.replace(opts, gpus=devices(opts))
    data = opts.data_dir.absolute()
    for sub in ("nats", "store", "logs", "run", "work"):
        (data / sub).mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(data / "run" / "stack.lock")
    except BlockingIOError:
        print(f"error: a stack is already running on {data}", file=sys.stderr, flush=True)
        return 1
    try:
        opts = with_people(opts)
    except (ValueError, OSError) as exc:
        lock.close()
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1

    loop = asyncio.get_running_loop()
    hurry = hurry if hurry is not None else asyncio.Event()
    reload = reload if reload is not None else asyncio.Event()
    own_signals = stop is None
    stop = stop if stop is not None else asyncio.Event()
    if own_signals:
        install_stop_signals(loop, stop, hurry)
        loop.add_signal_handler(signal.SIGHUP, reload.set)  # only state, as for the others

    server = hub(opts, NATS_STOP_TIMEOUT_S)
    supervisor = Supervisor(data / "logs", data / "run")

    async def reloading() -> None:
        nonlocal opts
        opts = await on_sighup(opts, server)

    specs: list[ServiceSpec] = []
    stack_json = data / "run" / "stack.json"
    try:
        try:
            await server.start()
            specs = build_specs(opts, server.url)
            await supervisor.start_all(specs)
        except (NatsServerError, OSError) as exc:
            print(f"error: the stack did not start: {exc}", file=sys.stderr, flush=True)
            return 1
        if build_specs is service_specs:  # Baton's own services, which declare the streams
            await _until_declared(opts, server.url)
        # Every node's: a site's leaf given them all keeps its link through any one's loss.
        sites_url = ",".join(server.ws_urls)
        _write_json(
            stack_json,
            {
                "nats_url": server.url,
                "site": opts.site,
                "auth": opts.auth,
                "sites_url": sites_url,
                "store_url": store_url(opts),
                "pids": {"supervisor": os.getpid(), **server.pids, **supervisor.pids()},
                "started_at": time.time(),
            },
        )
        _banner(opts, server, sites_url, out)
        print(f"logs: {data / 'logs'}", file=out, flush=True)
        catch_up(opts, reload)
        try:
            await _serve(server, stop, reload, reloading)
            print(
                "stopping: trainers first, to let them checkpoint (signal again to skip)",
                file=sys.stderr,
                flush=True,
            )
        except NatsServerError as exc:
            print(f"error: nats-server could not be restarted: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        await _uncancellable(_shutdown(supervisor, server, specs, hurry))
        with contextlib.suppress(FileNotFoundError):
            stack_json.unlink()
        if own_signals:
            remove_stop_signals(loop)
            loop.remove_signal_handler(signal.SIGHUP)
        lock.close()


READY_S = 60.0


async def _until_declared(opts: StackOptions, url: str) -> None:
    """Until the services have declared the stream a client's first publish goes to (the
    hub's submissions, a site's outbox) — and, on a hub that admits machines, until the
    registrar answers — so that the banner's URL is ready for `baton submit`. At most
    `READY_S`: a service that cannot start says why in its log, and the supervisor keeps
    restarting it meanwhile."""
    from nats.errors import Error as NatsError
    from nats.js.errors import Error as JetStreamError

    from shared.bus.connect import connect

    stream = names.OUTBOX_STREAM if opts.site else names.SUBMIT_STREAM
    deadline = time.monotonic() + READY_S
    nc = await connect(url, "baton-up", first_attempt_timeout=10, options=operator_options(opts))
    try:
        while time.monotonic() < deadline:
            try:
                await nc.jetstream().stream_info(stream)
                if admits_machines(opts):
                    # The people log in through it: the banner waits for it too.
                    await nc.request(names.REGISTRAR_HELLO, b"", timeout=2)
                return
            except (JetStreamError, NatsError, TimeoutError):
                await asyncio.sleep(0.2)
        print(f"warning: {stream} is not declared yet; see the logs", file=sys.stderr, flush=True)
    finally:
        await nc.close()


def _banner(opts: StackOptions, server: HubCluster, sites_url: str, out: IO[str]) -> None:
    """What `baton up` says it started, before its log directory."""
    print(f"nats: {server.url}", file=out)
    if len(server.nodes) > 1:
        print(
            f"hub: {len(server.nodes)} nodes, streams and buckets on "
            f"{opts.stream_replicas} of them",
            file=out,
        )
    if opts.site:
        print(f"site: {opts.site} (leaf of {opts.hub_url})", file=out)
    else:
        print(f"sites join at: {sites_url}", file=out)
    print(f"store: {store_url(opts)}", file=out)
    if usable := devices(opts):
        listed = ", ".join(f"{g.index} ({g.name})" for g in usable)
        print(f"gpus: {listed}; each trainer pinned to one, in turn", file=out)
    if (v := vault(opts)) is not None:
        ui = "" if opts.site else "; `baton ui`'s: dashboard.env"
        print(f"auth: on; credentials in {v.root} (the CLI's: operator.env{ui})", file=out)
    if admits_machines(opts):
        print("machines: admitted with a token (`baton token create`, then `baton join`)",
              file=out)  # fmt: skip


async def _serve(
    server: HubCluster,
    stop: asyncio.Event,
    reload: asyncio.Event | None = None,
    reloading: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Wait for the stop request; bring a server back if it dies meanwhile, since the
    services only reconnect to it, they cannot replace it. (A node of a cluster comes back
    on its store and catches up from its peers.) When `reload` is set, `reloading()` —
    here, between restarts, never during one: a server sent SIGHUP before it has set up its
    own signal handling would die of it."""
    reload = reload if reload is not None else asyncio.Event()
    stopping = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set():
            died = asyncio.create_task(server.wait_any())
            asked = asyncio.create_task(reload.wait())
            await asyncio.wait([stopping, died, asked], return_when=asyncio.FIRST_COMPLETED)
            asked.cancel()
            if stop.is_set() or reload.is_set():
                died.cancel()
            if stop.is_set():
                break
            if reload.is_set():
                reload.clear()  # before the reload reads: a later request is not lost
                if reloading is not None:
                    await reloading()
                continue
            node = died.result()
            log.warning(
                "nats-server %s exited with %s; restarting it", node.server_name, node.returncode
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), NATS_RESTART_DELAY_S)
            if not stop.is_set():
                await node.start()
    finally:
        stopping.cancel()


async def _shutdown(
    supervisor: Supervisor, server: HubCluster, specs: list[ServiceSpec], hurry: asyncio.Event
) -> None:
    try:
        await supervisor.stop(stop_order(specs), hurry=hurry)
    finally:
        if hurry.is_set():
            await server.kill()
        else:
            await server.stop()


async def _uncancellable(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to its end even if our caller is cancelled meanwhile (an interrupted
    shutdown is exactly how orphans are made), then pass the cancellation on."""
    task = asyncio.create_task(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


def hold_lock(path: Path) -> IO[str]:
    """Two stacks on one data dir would share a JetStream store and the pid files. A lock,
    not a pid check, because the kernel drops it when its holder dies, even by SIGKILL."""
    fh = open(path, "a")  # noqa: SIM115 - held open for as long as the stack runs
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        fh.close()
        raise
    return fh


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)
