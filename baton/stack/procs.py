"""Child-process supervision for Baton's own services (what `baton up` runs).

Three promises, each against a failure seen in an earlier setup, where a training process
orphaned by its dropped worker kept a GPU busy while nobody owned it:

* No orphans. Every child gets a parent-death signal, so a supervisor that is SIGKILLed (or
  OOM-killed) takes its children with it, at any moment, its own shutdown included. For a
  service that signal is SIGKILL: the graceful stop a SIGTERM starts needs the NATS server
  and the checkpointer, which go with the supervisor, and nothing would bound it any more
  (a trainer whose run hangs waited on the checkpoint it asked for and outlived `baton up`).
  Its runs are fenced by their leases and resume from their last commit, as after a lost
  machine. Each child also leads its own process group, so a Ctrl-C in the terminal
  reaches only the supervisor, which then stops the children in order instead of all of
  them at once.
* Crashes are retried, not fatal: a service that exits unexpectedly is restarted with an
  exponential back-off, so a crash loop costs little CPU and a healthy service that crashes
  once is back within half a second.
* Shutdown is ordered (see `Supervisor.stop`), bounded by per-group grace periods, and
  escalates to SIGKILL when the operator asks twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

# Named here too for the nats-server's supervision (`natsserver`).
from baton.stack.children import child_preexec as child_preexec
from baton.stack.children import open_log as open_log
from shared import backoff

log = logging.getLogger("baton.procs")

TRAINER_GRACE_S = 35.0
"""Trainers checkpoint and commit on SIGTERM within `BATON_GRACE` (30 s); a little more so
that a trainer finishing its commit on time is never cut off by our own SIGKILL."""
SERVICE_GRACE_S = 10.0

BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 10.0
BACKOFF_RESET_AFTER_S = 30.0

# Bounds the wait for the kernel to reap a SIGKILLed child; only a process stuck in
# uninterruptible sleep (a dead NFS mount, a wedged GPU driver) can outlast it.
_REAP_AFTER_KILL_S = 10.0



class ServiceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to run one service. `env` is laid over the supervisor's own environment, so
    PATH, HOME and the virtualenv stay visible to the child."""

    name: str
    argv: list[str]
    env: dict[str, str] = {}
    restart: bool = True
    cwd: str | None = None


class StopGroup(msgspec.Struct, frozen=True):
    """Services that are stopped together, and how long they get before SIGKILL."""

    names: list[str]
    grace_s: float = SERVICE_GRACE_S


class Backoff:
    """Delay before the next restart: doubles per crash, and forgets past crashes once the
    service has stayed up long enough to count as healthy again."""

    def __init__(
        self,
        initial: float = BACKOFF_INITIAL_S,
        maximum: float = BACKOFF_MAX_S,
        reset_after: float = BACKOFF_RESET_AFTER_S,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.reset_after = reset_after
        self._delays = backoff.Backoff(initial, maximum)

    def after_exit(self, uptime_s: float) -> float:
        if uptime_s >= self.reset_after:
            self._delays.reset()
        return self._delays.next()


class _Service:
    def __init__(self, spec: ServiceSpec, backoff: Backoff) -> None:
        self.spec = spec
        self.backoff = backoff
        self.proc: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task[None] | None = None
        self.stop_sig: int | None = None
        self.wake = asyncio.Event()
        self.returncode: int | None = None
        self.restarts = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def send(self, sig: int) -> None:
        """Remember the strongest signal asked for, so that a child still being spawned
        gets it the moment it exists; deliver it now to a child that is running."""
        if self.stop_sig != signal.SIGKILL:
            self.stop_sig = sig
        self.wake.set()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        try:
            if sig == signal.SIGKILL:
                # The whole group: a service's own helpers must not outlive a hard stop.
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass


class Supervisor:
    """Starts services as child processes and keeps them running until `stop()`.

    Logs go to `<log_dir>/<name>.log` (appended across restarts), the current pid to
    `<run_dir>/<name>.pid`.
    """

    def __init__(
        self,
        log_dir: Path,
        run_dir: Path,
        *,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        backoff_reset_after_s: float = BACKOFF_RESET_AFTER_S,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.run_dir = Path(run_dir)
        self._backoff = (backoff_initial_s, backoff_max_s, backoff_reset_after_s)
        self._services: dict[str, _Service] = {}
        self._closing = False
        self._stop_lock = asyncio.Lock()

    # -- queries --------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._services)

    def pid(self, name: str) -> int | None:
        svc = self._services[name]
        return svc.proc.pid if svc.alive() and svc.proc is not None else None

    def pids(self) -> dict[str, int]:
        return {n: p for n in self._services if (p := self.pid(n)) is not None}

    def returncode(self, name: str) -> int | None:
        """Status of the service's last exit (negative: killed by that signal)."""
        return self._services[name].returncode

    def restarts(self, name: str) -> int:
        return self._services[name].restarts

    # -- starting -------------------------------------------------------------------

    async def start(self, spec: ServiceSpec) -> int:
        """Start one service and return its pid; raises OSError if it cannot be spawned."""
        if self._closing:
            raise RuntimeError("supervisor is stopping; not starting " + spec.name)
        if spec.name in self._services:
            raise ValueError(f"service {spec.name!r} already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        svc = _Service(spec, Backoff(*self._backoff))
        self._services[spec.name] = svc
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # The spawn runs inside the service's own task, so that a stop() that begins
        # meanwhile, or a cancellation of this call, can never miss a process being born.
        # (That task runs on the event loop's thread, which lives as long as the supervisor:
        # the parent-death signal is tied to the forking thread, not the process.)
        svc.task = asyncio.create_task(self._run(svc, started), name=f"supervise-{spec.name}")
        return await asyncio.shield(started)

    async def start_all(self, specs: Iterable[ServiceSpec]) -> None:
        for spec in specs:
            await self.start(spec)

    async def _spawn(self, svc: _Service) -> None:
        spec = svc.spec
        log_path = self.log_dir / f"{spec.name}.log"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open_log(log_path, f"--- {stamp} starting {spec.name}: {' '.join(spec.argv)}") as out:
            svc.proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **spec.env},
                cwd=spec.cwd,
                process_group=0,
                preexec_fn=child_preexec(os.getpid(), signal.SIGKILL),
            )
        _write_pid(self.run_dir / f"{spec.name}.pid", svc.proc.pid)
        log.info("%s started (pid %d)", spec.name, svc.proc.pid)
        if svc.stop_sig is not None:
            svc.send(svc.stop_sig)

    async def _run(self, svc: _Service, started: asyncio.Future[int]) -> None:
        try:
            await self._spawn(svc)
        except Exception as exc:
            del self._services[svc.spec.name]
            started.set_exception(exc)
            return
        assert svc.proc is not None
        started.set_result(svc.proc.pid)
        await self._watch(svc)

    async def _watch(self, svc: _Service) -> None:
        name = svc.spec.name
        loop = asyncio.get_running_loop()
        while True:
            proc = svc.proc
            assert proc is not None
            started = loop.time()
            svc.returncode = rc = await proc.wait()
            _sweep_group(proc.pid)
            uptime = loop.time() - started
            if self._closing or svc.stop_sig is not None:
                log.info("%s exited with %d", name, rc)
                break
            if not svc.spec.restart:
                log.error("%s exited with %d; not restarting", name, rc)
                break
            while not self._closing and svc.stop_sig is None:
                delay = svc.backoff.after_exit(uptime)
                log.warning("%s exited with %d; restarting in %g s", name, rc, delay)
                svc.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(svc.wake.wait(), delay)
                if self._closing or svc.stop_sig is not None:
                    break
                try:
                    await self._spawn(svc)
                except OSError as exc:  # e.g. out of file descriptors: worth another try
                    log.error("%s could not be restarted: %s", name, exc)
                    uptime = 0.0
                    continue
                svc.restarts += 1
                break
            if svc.proc is proc:
                break
        _remove(self.run_dir / f"{name}.pid")

    # -- stopping -------------------------------------------------------------------

    async def stop(
        self, groups: Sequence[StopGroup] = (), *, hurry: asyncio.Event | None = None
    ) -> None:
        """Stop every service, group by group, and return once each child is reaped.

        The caller names the order because only it knows the dependencies. For `baton up`
        it is: trainers first, because a SIGTERMed trainer checkpoints its run and must
        still reach NATS and a live checkpointer to commit that checkpoint and hand the run
        back; then dispatcher and checkpointer, which by then have nothing left to serve;
        the NATS server last of all (the caller's job, after this returns). Services named
        in no group are stopped after the groups, with the default grace.

        Within a group: SIGTERM to all, wait up to the group's grace, SIGKILL whoever is
        left. Once `hurry` is set (a second Ctrl-C), every remaining child gets SIGKILL at
        once. Nothing is restarted once this has begun. Idempotent, and safe in `finally`.
        """
        async with self._stop_lock:
            self._closing = True
            hurry = hurry if hurry is not None else asyncio.Event()
            for members, grace_s in self._plan(groups):
                await self._stop_group(members, grace_s, hurry)

    def _plan(self, groups: Sequence[StopGroup]) -> list[tuple[list[_Service], float]]:
        plan: list[tuple[list[_Service], float]] = []
        seen: set[str] = set()
        for group in groups:
            members = []
            for name in group.names:
                if name in self._services and name not in seen:
                    members.append(self._services[name])
                    seen.add(name)
                elif name not in self._services:
                    log.debug("stop order names %s, which was never started", name)
            plan.append((members, group.grace_s))
        rest = [svc for name, svc in self._services.items() if name not in seen]
        plan.append((rest, SERVICE_GRACE_S))
        return plan

    async def _stop_group(
        self, members: list[_Service], grace_s: float, hurry: asyncio.Event
    ) -> None:
        tasks = [svc.task for svc in members if svc.task is not None and not svc.task.done()]
        if not tasks:
            return
        first = signal.SIGKILL if hurry.is_set() else signal.SIGTERM
        log.info(
            "stopping %s (%s)",
            ", ".join(svc.spec.name for svc in members),
            "SIGKILL" if hurry.is_set() else f"grace {grace_s:g} s",
        )
        for svc in members:
            svc.send(first)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        hurried = asyncio.create_task(hurry.wait())
        try:
            while not hurry.is_set():
                running = [t for t in tasks if not t.done()]
                left = deadline - loop.time()
                if not running or left <= 0:
                    break
                await asyncio.wait(
                    [*running, hurried], timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            hurried.cancel()
        for svc in members:
            if svc.task is not None and not svc.task.done():
                if svc.alive() and not hurry.is_set():
                    log.warning("%s did not stop in time; killing it", svc.spec.name)
                svc.send(signal.SIGKILL)
        _, pending = await asyncio.wait(tasks, timeout=_REAP_AFTER_KILL_S)
        for task in pending:
            log.error(
                "%s survived SIGKILL for %g s; giving up on it", task.get_name(), _REAP_AFTER_KILL_S
            )


def _sweep_group(pgid: int) -> None:
    """SIGKILL whatever is left in a reaped service's process group. While any member lives
    the kernel keeps the group id reserved; once none does, the id is only reused after the
    pid counter wraps around, far later than this call, which follows the reaping at once."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _write_pid(path: Path, pid: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
