"""Start the committed NATS configs (deploy/nats/) with the real nats-server, on loopback.

A config is copied into a temporary directory with every listener moved to
`127.0.0.1:-1` (the server picks a free port and reports it in its ports file, so there is
no probe-then-bind race), its store and certificate paths moved under that directory, and
its leafnode remote pointed at the hub under test. Everything else — domains, pings,
reconnect, TLS blocks, a cluster's authorization — is the committed text, so the test
exercises the file compose runs. A hub node gets what compose gives it: its environment
(interpolated as compose does, the route URLs moved to loopback) and its certificates, at
the paths compose mounts them (`node_env`, `mount_certs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from baton.stack.children import open_log
from baton.stack.natsserver import find_binary

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "deploy" / "nats"
CERT_SCRIPT = REPO / "deploy" / "certs" / "gen-dev-certs.sh"
ROUTE_CERT_SCRIPT = NATS_DIR / "dev" / "gen-route-certs.sh"

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05

_LISTENER = re.compile(r"^(?P<lead>\s*(?:listen|http)\s*:\s*)(?P<addr>\S+)\s*$", re.M)
_STORE = re.compile(r'^(?P<lead>\s*store_dir\s*:\s*)"[^"]*"\s*$', re.M)
_REMOTE_URL = re.compile(r'"(?:wss?|nats-leaf|nats)://[^"]+"')
_PORT_KEY = re.compile(r"^\s*(?:port|http_port|https_port)\s*:", re.M)
_INCLUDE = re.compile(r'^\s*include\s+"(?P<file>[^"]+)"\s*$', re.M)
_PASSWORD_VAR = re.compile(r"\$(BATON_PW_[A-Z0-9_]+)")
HUB_URL_VAR = "$BATON_HUB_URL"
_CLUSTER = re.compile(r"^cluster\s*\{.*?^\}", re.M | re.S)
_CLUSTER_LISTEN = re.compile(r"^\s*listen\s*:\s*\S+\s*$", re.M)
_COMPOSE_VAR = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::-(?P<default>[^}]*))?\}")


def passwords_for(text: str) -> dict[str, str]:
    """A password for every `$BATON_PW_*` a localized config reads from the environment."""
    return {name: f"pw-{name.lower()}" for name in _PASSWORD_VAR.findall(text)}


def strip_comments(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


def listeners(text: str) -> list[str]:
    """The `listen:`/`http:` addresses of a config, in file order (comments ignored)."""
    return [m["addr"] for m in _LISTENER.finditer(strip_comments(text))]


def localize(
    text: str,
    workdir: Path,
    *,
    certs_dir: Path | None = None,
    remote_url: str | list[str] | None = None,
    route_port: int | None = None,
) -> str:
    """The config, runnable on loopback under `workdir` (see the module docstring).
    `remote_url`: one URL, or a list (a clustered hub's nodes). `route_port`: where a
    `cluster` block listens instead (its routes come from the environment, `node_env`).

    Raises AssertionError when the config has a shape this rewrite cannot vouch for (a
    `port:` key that would escape the move to loopback, no store, several remotes), so a
    change to the committed file cannot silently make the test bind elsewhere.
    """
    body = inline_includes(strip_comments(text))
    assert not _PORT_KEY.search(body), "use `listen: host:port` / `http: host:port` only"
    if route_port is not None:
        body = _with_route_port(body, route_port)
    else:
        assert not _CLUSTER.search(body), "a cluster node needs its route ports"
    out, n = _LISTENER.subn(r"\g<lead>127.0.0.1:-1", body)
    assert n >= 2, f"expected client and monitoring listeners, found {n}"
    out, n = _STORE.subn(rf'\g<lead>"{workdir / "store"}"', out)
    assert n == 1, f"expected one quoted jetstream store_dir, found {n}"
    if certs_dir is not None:
        assert "/etc/nats/certs/" in out, "no certificate paths to move"
        out = out.replace("/etc/nats/certs/", f"{certs_dir}/")
    urls = _REMOTE_URL.findall(out)
    if remote_url is not None and HUB_URL_VAR in out:
        assert not urls, f"the hub URL comes from {HUB_URL_VAR}, yet {urls} is written"
        # A list is written as an array: what the server makes of an environment value
        # holding one (docs/nats.md).
        out = out.replace(HUB_URL_VAR, json.dumps(remote_url))
    elif remote_url is not None:
        assert len(urls) == 1, f"expected one leafnode remote url, found {urls}"
        out = out.replace(urls[0], json.dumps(remote_url))
    else:
        assert not urls, f"unexpected remote urls {urls}"
    assert "0.0.0.0" not in out
    return f'ports_file_dir: "{workdir}"\n' + out


def inline_includes(body: str) -> str:
    """`include "x.conf"` replaced by deploy/nats/x.conf, comments stripped, recursively
    (hub-node.conf includes hub.conf, which includes auth-hub.conf)."""
    while _INCLUDE.search(body):
        body = _INCLUDE.sub(lambda m: strip_comments((NATS_DIR / m["file"]).read_text()), body)
    return body


def _with_route_port(body: str, port: int) -> str:
    """The cluster block listening on loopback `port`; everything else in it (name,
    authorization, TLS, the routes' variable) as committed."""
    (block,) = _CLUSTER.findall(body)
    assert re.search(r"^\s*name\s*:\s*\S+\s*$", block, re.M), "a cluster needs its name"
    # host/port rather than `listen`, which the move of every listener to -1 would catch.
    new, n = _CLUSTER_LISTEN.subn(f"  host: 127.0.0.1\n  port: {port}", block)
    assert n == 1, f"expected one cluster listener, found {n}"
    return body.replace(block, new)


def compose_service(name: str) -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    return dict(services[name])


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """compose's `${NAME:-default}` and `${NAME}`: `env`'s value, else the default."""
    return _COMPOSE_VAR.sub(lambda m: env.get(m["name"], m["default"] or ""), value)


def node_env(name: str, route_ports: Mapping[str, int]) -> dict[str, str]:
    """Hub node `name`'s environment as compose gives it, every `${BATON_PW_*}` the test's
    password (`passwords_for`), and each route URL's `hub-N:6222` the loopback port
    `route_ports["hub-N"]` — user and password exactly as compose writes them."""
    env = {k: str(v) for k, v in (compose_service(name).get("environment") or {}).items()}
    names = {m["name"] for v in env.values() for m in _COMPOSE_VAR.finditer(v)}
    given = passwords_for(" ".join(f"${n}" for n in names))
    env = {k: interpolate(v, given) for k, v in env.items()}
    routes = json.loads(env["BATON_ROUTES"])
    local = [
        re.sub(r"@([\w-]+):\d+$", lambda m: f"@127.0.0.1:{route_ports[m[1]]}", u) for u in routes
    ]
    assert all("@127.0.0.1:" in u for u in local), local
    return {**env, "BATON_ROUTES": json.dumps(local)}


def mount_certs(name: str, generated: Path, dest: Path) -> Path:
    """`dest` laid out as compose service `name`'s /etc/nats/certs: each file it mounts
    there, copied from `generated` (where the scripts wrote them) under its mounted name."""
    dest.mkdir(parents=True, exist_ok=True)
    for v in compose_service(name).get("volumes") or []:
        if isinstance(v, dict) and v["target"].startswith("/etc/nats/certs/"):
            shutil.copy2(generated / Path(v["source"]).name, dest / Path(v["target"]).name)
    return dest


class ConfiguredServer:
    """One nats-server process running a localized config; see `localize`."""

    def __init__(self, name: str, config: str, workdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.workdir = workdir
        self.config = config
        self.env = {**os.environ, **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.ports: dict[str, list[str]] = {}

    @property
    def config_path(self) -> Path:
        return self.workdir / f"{self.name}.conf"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def _port(self, kind: str) -> int:
        return int(self.ports[kind][0].rsplit(":", 1)[1])

    @property
    def client_url(self) -> str:
        return f"nats://127.0.0.1:{self._port('nats')}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self._port('monitoring')}"

    @property
    def ws_port(self) -> int:
        return self._port("websocket")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def start(self) -> ConfiguredServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config)
        with open_log(self.log_path) as log:
            self.proc = await asyncio.create_subprocess_exec(
                str(find_binary()),
                "-c",
                str(self.config_path),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=self.env,
                process_group=0,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        ports_file = self.workdir / f"nats-server_{self.proc.pid}.ports"
        while True:
            if self.proc.returncode is not None:
                raise AssertionError(
                    f"{self.name}: nats-server exited {self.proc.returncode}:\n{self.log()}"
                )
            with contextlib.suppress(OSError, ValueError):
                self.ports = json.loads(ports_file.read_text())
                if "nats" in self.ports:
                    return self
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no ports file after {START_TIMEOUT_S:g} s")
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def monitor(self, path: str) -> Any:
        """GET a monitoring endpoint (`/leafz`, `/varz`, ...) as JSON."""

        def get() -> Any:
            with urllib.request.urlopen(self.http_url + path, timeout=2.0) as resp:
                return json.loads(resp.read())

        return await asyncio.to_thread(get)

    async def leaf_names(self) -> list[str]:
        return [leaf.get("name", "") for leaf in (await self.monitor("/leafz")).get("leafs") or []]


async def check_config(
    text: str, workdir: Path, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """`nats-server -t` on a config text: (exit status, output)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "check.conf"
    path.write_text(text)
    proc = await asyncio.create_subprocess_exec(
        str(find_binary()),
        "-t",
        "-c",
        str(path),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 20.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(errors="replace")


async def gen_certs(out_dir: Path, script: Path = CERT_SCRIPT) -> None:
    """Run deploy/certs/gen-dev-certs.sh into `out_dir` (a new CA and hub certificate), or
    another script of the same usage (`ROUTE_CERT_SCRIPT`)."""
    proc = await asyncio.create_subprocess_exec(
        "bash",
        str(script),
        str(out_dir),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, f"{script.name} failed:\n{out.decode(errors='replace')}"
