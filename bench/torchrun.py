"""torchrun as the baseline a recovery is measured against: one worker script under
`torch.distributed.run --max-restarts 1`, SIGKILLed mid-run, timed from the signal to the
restarted worker's first step.

The worker scripts (`bench/hf_torchrun.py`, `bench/paced_torchrun.py`) append
`<time.time()> <step> <pid>` to a step log for every step, and two marks: when the script
began (step -1, before its imports) and when its training loop started (step 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.stack import alive, children_of

REPO = Path(__file__).resolve().parents[1]
Row = tuple[float, int, int]
"""(time, step, pid) of one line of a step log."""


def kill_worker(script: Path, args: list[str], kill_at: int, total: int) -> dict[str, float]:
    """Run `script` under torchrun (one restart) with `args` (`--step-log` is added), SIGKILL
    its worker once it logged step `kill_at`, and wait for the run to reach `total`. Returns
    the phases from the signal to the restarted worker's first step ("total" among them)."""
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        steps = Path(tmp) / "steps.txt"
        with socket.socket() as s:  # a free loopback port for the static rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--max-restarts", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(script), "--step-log", str(steps), *args,
        ]  # fmt: skip
        console = open(Path(tmp) / "torchrun.log", "wb")  # noqa: SIM115 - closed in finally
        agent = subprocess.Popen(
            cmd, cwd=REPO, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        ours: set[int] = set()

        def runs_script(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return script.name.encode() in f.read()
            except FileNotFoundError:
                return False

        try:
            wait_rows(steps, agent, lambda rows: rows[-1][1] >= kill_at)
            workers = [p for p in children_of(agent.pid) if runs_script(p)]
            ours.update(children_of(agent.pid))
            assert len(workers) == 1, f"torchrun's workers: {workers}"
            (worker,) = workers
            at_signal = time.time()
            os.kill(worker, signal.SIGKILL)
            rows = wait_rows(steps, agent, lambda rows: rows[-1][2] != worker and rows[-1][1] > 0)
            ours.update(children_of(agent.pid))
            new = {step: t for t, step, pid in rows if pid != worker}
            step = min(k for k in new if k > 0)
            code = agent.wait(timeout=180)
            assert code == 0, f"torchrun exited {code}: {tail(Path(tmp) / 'torchrun.log')}"
            assert read_rows(steps)[-1][1] == total
            return {
                "total": new[step] - at_signal,
                "signal -> restarted worker's script began": new[-1] - at_signal,
                "  -> its training loop began (imports, model)": new[0] - new[-1],
                "  -> its first step (loads the checkpoint, one step)": new[step] - new[0],
                "resumed at step": float(step),
            }
        finally:
            ours.update(children_of(agent.pid))
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
            for pid in ours:  # the workers lead sessions of their own
                if alive(pid) and runs_script(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            console.close()


def read_rows(path: Path) -> list[Row]:
    """Every complete line of a step log; a last line still being written is left for the
    next read."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().split("\n")[:-1]:
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def wait_rows(
    path: Path, agent: subprocess.Popen[bytes], done: Callable[[list[Row]], bool]
) -> list[Row]:
    deadline = time.monotonic() + 180
    while True:
        rows = read_rows(path)
        if rows and done(rows):
            return rows
        if agent.poll() is not None:
            console = path.parent / "torchrun.log"
            raise AssertionError(f"torchrun exited {agent.returncode} early: {tail(console)}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the torchrun worker's steps")
        time.sleep(0.005)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]
