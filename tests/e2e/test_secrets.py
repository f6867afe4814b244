"""Secrets stay secret: run a job through a hub and a site with auth on, an S3 store with
keys and OpenTelemetry exporting to a collector we hold, then search everything Baton
captured — every stream and bucket, every log, every checkpoint object, every exported
trace and metric — for the NATS passwords and the S3 keys. None may appear.

Where secrets legitimately live is left out of the search: the generated credential files
and the servers' own configuration files.
"""

from __future__ import annotations

import http.server
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import names
from shared.checkpoint.store import open_store
from shared.contracts import RunState
from tests.e2e.jobs import finished, job, submit
from tests.support.seaweed import SeaweedS3
from tests.support.sites import Site
from tests.support.stack import Stack, eventually

# Distinctive, so that a hit cannot be a coincidence.
SECRET_KEY = "s3-secret-" + uuid.uuid4().hex
ACCESS_KEY = "s3-access-" + uuid.uuid4().hex[:12]


class Collector:
    """An OTLP/HTTP endpoint that keeps every request body it is sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        bodies = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def seaweed(monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    with SeaweedS3(access_key=ACCESS_KEY, secret_key=SECRET_KEY) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


@pytest.fixture
def collector() -> Iterator[Collector]:
    with Collector() as c:
        yield c


@pytest.fixture
async def hub(tmp_path: Path, seaweed: SeaweedS3, collector: Collector) -> AsyncIterator[Stack]:
    env = {
        **seaweed.env(),
        "BATON_STORE": seaweed.url(f"secrets-{uuid.uuid4().hex[:8]}"),
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
    }
    s = Stack(tmp_path / "hub", trainers=1, lease_ttl=6, env=env)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


@pytest.mark.timeout(120)
async def test_no_secret_appears_in_anything_baton_captured(
    hub: Stack, collector: Collector
) -> None:
    site = Site(hub, "lab1")  # its services get the hub's environment: S3 and OTLP too
    await site.start(trainers=1)
    nc = await hub.client()
    at_site = await site.client()
    from baton.client import calls as client

    run_ids = [await submit(nc, job(total_steps=40, checkpoint={"every_steps": 10}))]
    run_id, _ = await client.submit(at_site, job(total_steps=40), 10, "lab1")
    run_ids.append(run_id)
    for r in run_ids:
        assert (await finished(nc, r, timeout=60)).state is RunState.COMPLETED

    secrets = _secrets(hub, site)
    captured = await _captured(nc, hub, site, run_ids)
    await _until(lambda: len(collector.bodies) > 0, "traces and metrics to be exported")
    for i, body in enumerate(collector.bodies):
        captured[f"otlp #{i}"] = body
    _assert_no_secret_in(captured, secrets)


def _secrets(hub: Stack, site: Site) -> dict[str, str]:
    """What must never appear, by what it is: the S3 keys, every NATS password of the hub
    and the site, and the lease secret."""
    secrets = {"S3 secret key": SECRET_KEY, "S3 access key": ACCESS_KEY}
    for path in (hub.root / "auth").glob("*.env"):
        secrets[f"NATS password of {path.stem}"] = _password(path)
    for path in (site.root / "auth").glob("*.env"):
        secrets[f"NATS password of {path.stem}"] = _password(path)
    secrets["lease secret"] = (hub.root / "auth" / "lease.secret").read_text().strip()
    return secrets


async def _captured(nc: Client, hub: Stack, site: Site, run_ids: list[str]) -> dict[str, bytes]:
    """Everything Baton kept, by where it was found: every stream and bucket of the hub,
    the site's outbox and checkpoint streams, every file under the hub's and the site's
    directories (logs included) but those that hold secrets by design, and every object
    of the runs in the store."""
    captured: dict[str, bytes] = {}
    buckets = (names.RUNS_BUCKET, names.LEASES_BUCKET, names.WORKERS_BUCKET, names.POOLS_BUCKET)
    for stream in (*names.ALL_STREAMS, *(f"KV_{b}" for b in buckets)):
        captured.update(await everything(nc.jetstream(), stream))
    site_js = (await site.client()).jetstream()
    for stream in (names.OUTBOX_STREAM, names.CKPT_STREAM):
        captured.update(await everything(site_js, stream))
    for root in (hub.root, site.root):
        for path in root.rglob("*"):
            if path.is_file() and not _holds_secrets_by_design(path):
                captured[str(path)] = path.read_bytes()
    async with open_store(hub.opts.extra_env["BATON_STORE"]) as store:
        for r in run_ids:
            for key in await store.list(f"runs/{r}/"):
                captured[f"store {key}"] = await store.get(key)
    return captured


def _assert_no_secret_in(captured: dict[str, bytes], secrets: dict[str, str]) -> None:
    """The search covered checkpoints and logs, and found none of `secrets`."""
    assert any(k.startswith("store ") for k in captured), "checkpoints were searched"
    assert any("logs" in k for k in captured), "logs were searched"
    leaks = [
        f"{what} in {where}"
        for what, secret in secrets.items()
        for where, data in captured.items()
        if secret.encode() in data
    ]
    assert not leaks, f"secrets leaked: {leaks[:10]}"


async def everything(js: JetStreamContext, stream: str) -> dict[str, bytes]:
    """Every message a stream holds, headers included, read one by one (work queues allow
    no consumer of ours)."""
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return {}
    out = {}
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError:
            continue  # acked or deleted
        headers = repr(sorted((msg.headers or {}).items())).encode()
        out[f"{stream} #{seq} {msg.subject}"] = (msg.data or b"") + headers
    return out


def _password(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("NATS_PASSWORD="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no password in {path}")


def _holds_secrets_by_design(path: Path) -> bool:
    return path.parent.name == "auth" or path.name == "nats-server.conf"


async def _until(check: Callable[[], bool], what: str) -> None:
    async def ok() -> bool:
        return check()

    await eventually(ok, 20, what)
