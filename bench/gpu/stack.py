"""`baton up` as an operator runs it, for the proofs: started as its own process (`python -m
baton up`, no console script needed), its trainers on the host's GPU (each pinned to it by
`baton up`; several trainers share one GPU), a `file://` store on local disk, its operator's
credentials from its data directory; trainers killed by their pid files; stopped at the end
with nothing of it left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from nats.aio.client import Client

from baton.client import calls as client
from baton.stack.procs import child_preexec
from shared import credentials
from shared.bus import names
from shared.contracts.control import WorkerInfo
from tests.support.stack import alive, attempt_processes, children_of, eventually

START_S = 120.0
"""Until every trainer has said it is there (each imports torch into its zygote first)."""
STOP_S = 50.0
"""`baton up` gives its trainers 35 s (`baton.stack.procs.TRAINER_GRACE_S`); with runs, they
checkpoint within `BATON_GRACE` (10 s here) and go."""
LEASE_TTL_S = 4


class Up:
    def __init__(self, root: Path, trainers: int, env: dict[str, str]) -> None:
        self.root = root
        self.data = root / "baton"
        self.trainers = trainers
        self.env = {
            **os.environ,
            # Local snapshots on local disk: a container's /dev/shm is often 64 MB.
            "BATON_SNAPSHOTS": str(root / "snapshots"),
            "BATON_PROGRESS_INTERVAL": "0.1",
            "BATON_GRACE": "10",
            **env,
        }
        self.proc: asyncio.subprocess.Process | None = None
        self.nc: Client | None = None
        self.url = ""

    @property
    def store_url(self) -> str:
        return f"file://{self.data / 'store'}"

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "baton", "up", "--data-dir", str(self.data), "--port", "0",
            "--ws-port", "0", "--trainers", str(self.trainers), "--lease-ttl", str(LEASE_TTL_S),
        ]  # fmt: skip
        with (self.root / "up.log").open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=log, env=self.env,
                preexec_fn=child_preexec(os.getpid(), signal.SIGTERM),
            )  # fmt: skip
        self.url = await self._url()
        operator = credentials.read_env_file(self.data / "auth" / "operator.env")
        self.nc = await client.open_nats(self.url, **credentials.options_for(operator))
        await client.wait_for_services(self.nc, "default", START_S)
        await eventually(self._all_there, START_S, f"{self.trainers} trainers", every=0.5)

    async def _url(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + START_S
        while (left := deadline - time.monotonic()) > 0:
            line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            if not line:
                break
            if line.startswith(b"nats: "):
                return line.decode().split(" ", 1)[1].strip()
        raise RuntimeError(f"`baton up` did not start; see {self.root / 'up.log'}")

    def nats(self) -> Client:
        assert self.nc is not None, "`baton up` has not been started"
        return self.nc

    async def _all_there(self) -> bool:
        return len(await self.workers()) >= self.trainers

    async def workers(self) -> list[WorkerInfo]:
        return await client.workers(self.nats())

    def pid(self, worker: str) -> int:
        return int((self.data / "run" / f"{worker}.pid").read_text())

    def zygote(self, worker: str) -> int | None:
        """The trainer's zygote (`services/trainer/zygote.py`): its child started with
        `--zygote`."""
        pid = self.pid(worker)
        ours = set(attempt_processes(pid))
        for kid in children_of(pid):
            with contextlib.suppress(OSError):
                if kid not in ours and b"--zygote" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    return kid
        return None

    def attempt(self, worker: str) -> list[int]:
        """The trainer's training processes and what they started (data loader workers)."""
        return attempt_processes(self.pid(worker))

    async def idle_besides(self, worker: str, timeout: float = 60.0) -> None:
        """Until a live trainer other than `worker` holds no run and waits for a task (a
        pull request of the pool's consumer waits: a trainer with a run pulls none): the
        one a run of `worker` is handed over to when `worker` is killed."""
        js = self.nats().jetstream()

        async def idle() -> bool:
            if not any(w.run_id is None and w.worker != worker for w in await self.workers()):
                return False
            info = await js.consumer_info(names.TASKS_STREAM, names.trainer_consumer("default"))
            return bool(info.num_waiting)

        await eventually(idle, timeout, f"a trainer besides {worker} to be free", every=0.2)

    def forget(self, *runs: str) -> None:
        """Remove ended runs' checkpoints from the store: the disk is the next proof's."""
        for run in runs:
            shutil.rmtree(self.data / "store" / "runs" / run, ignore_errors=True)

    def kill(self, worker: str) -> list[int]:
        """SIGKILL the trainer; its process and its descendants (zygote, training process,
        loader workers) as they were just before."""
        pid = self.pid(worker)
        family = [pid, *children_of(pid)]
        os.kill(pid, signal.SIGKILL)
        return family

    async def stop(self) -> list[str]:
        """Stop `baton up` (SIGTERM: it stops its services in order), SIGKILL it if it takes
        longer than `STOP_S`; then whatever of the stack is still running after 15 s is
        SIGKILLed and named in the answer (empty: nothing was left)."""
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

        async def gone() -> bool:
            return not leftovers(self.root)

        with contextlib.suppress(AssertionError):
            await eventually(gone, 15, "every process of the stack to exit", every=0.2)
        left = leftovers(self.root)
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return [f"{pid} {what}" for pid, what in left]

    def log_tails(self, lines: int = 40) -> str:
        """The end of every log of the stack (services, runs), for a failed proof's report."""
        out = []
        logs = sorted(self.root.glob("*.log")) + sorted(self.data.glob("logs/*.log"))
        logs += sorted(self.data.glob("work/*/logs/*.log"))
        for path in logs:
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"==> {path.relative_to(self.root)} <==\n" + "\n".join(text))
        return "\n\n".join(out)


def leftovers(root: Path) -> list[tuple[int, str]]:
    """Live processes whose command line or environment names `root`: the stack's own
    (nats-server, services, zygotes, training processes, loader workers)."""
    mark = str(root).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (mark in cmdline or mark in environ) and alive(int(entry)):
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]))
    return found
