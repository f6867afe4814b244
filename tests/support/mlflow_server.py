"""A real MLflow tracking server for tests: `mlflow server` on a free loopback port, its
runs in a SQLite file and its artifacts in a folder of its own directory.

`MlflowServer(dir)` starts it and returns once `/health` answers (bounded: a server that
does not answer within `START_S` fails the test); `close()` stops it and whatever it
started (its process group)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
START_S = 120.0
"""How long the server may take to answer (9 s measured on an idle 2-core machine)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class MlflowServer:
    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.uri = f"http://{HOST}:{self.port}"
        mlflow = Path(sys.executable).parent / "mlflow"
        self._log = open(root / "mlflow.log", "wb")  # noqa: SIM115 - closed by close()
        self._proc = subprocess.Popen(
            [
                str(mlflow), "server", "--host", HOST, "--port", str(self.port),
                "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                "--default-artifact-root", str(root / "artifacts"),
            ],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
        )  # fmt: skip
        try:
            self._wait(root)
        except BaseException:
            self.close()
            raise

    def _wait(self, root: Path) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(root / 'mlflow.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)  # polling a server's readiness, which sends no signal
        raise RuntimeError(f"mlflow server did not answer in {START_S:.0f}s")

    def close(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._log.close()
