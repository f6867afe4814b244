"""`python -m bench.gpu`: the proofs (this package's docstring) against one `baton up`, each
within its own time limit and all within `--budget` seconds; `gpu.json` and `gpu.md` into
`--out`, the stack's logs too (`gpu-logs.txt`) when a proof failed. Exit 0 when every
proof passed and nothing of the stack outlived it, 1 otherwise."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from baton.client import calls as client
from bench.gpu import costs, device, resume
from bench.gpu.report import Proof, Proving, Report
from bench.gpu.sizes import FULL, QUICK, Sizes
from bench.gpu.stack import Up
from tests.support.audit import Audit

TRAINERS = 4
"""Three runs side by side (a reference and two to interrupt) and one trainer free to take
over a killed one, all on the one GPU."""
MIN_LEFT_S = 20.0
"""A proof is not started with less of the budget left than this."""
STOP_RESERVE_S = 60.0
"""Of the budget, kept for stopping the stack and writing the report."""

Run = Callable[[Proving, float], Awaitable[None]]


def proofs(up: Up, sizes: Sizes, gpu: bool, env: dict[str, str]) -> list[tuple[str, str, Run]]:
    """(key, title, the proof given its deadline), in the order they run."""
    return [
        ("zygote", "2. The zygote and the GPU", lambda p, d: device.zygote(up, sizes, p, gpu)),
        ("exact", "1. Exact resume (GPT, bf16)", lambda p, d: resume.exact(up, sizes, p, gpu, d)),
        ("framework", "5. HF Trainer, Llama, bf16", lambda p, d: resume.framework(up, sizes, p, d)),
        ("cost", "3. Checkpoint cost at size", lambda p, d: costs.cost(up, sizes, p, gpu, d)),
        ("overhead", "4. Overhead", lambda p, d: costs.overhead(up, sizes, p, env, d)),
    ]


async def prove(
    out: Path, root: Path, cpu: bool, quick: bool, budget_s: float, only: set[str]
) -> Report:
    """Every proof against one stack under `root` (removed at the end); SIGTERM stops them
    where they are, and the stack, the report still written."""
    began = time.monotonic()
    me = asyncio.current_task()
    assert me is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
    deadline = began + budget_s - STOP_RESERVE_S
    sizes = QUICK if quick else FULL
    env = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    report = Report(mode=("cpu" if cpu else "gpu") + (" quick" if quick else ""), budget_s=budget_s)
    report.machine = machine(env)
    gpu = not cpu
    if gpu and not report.machine.get("gpu"):
        error = "no GPU here (nvidia-smi lists none): run with --cpu"
        report.proofs.append(Proof(key="gpu", title="a GPU", error=error))
        report.seconds = time.monotonic() - began
        report.write(out)
        return report
    report.machine["disk_free_gb"] = round(shutil.disk_usage(root).free / 1e9, 1)
    up = Up(root, TRAINERS, env)
    failed = False
    try:
        starting = time.monotonic()
        await up.start()
        report.machine["stack_start_s"] = round(time.monotonic() - starting, 2)
        for key, title, run in proofs(up, sizes, gpu, env):
            if only and key not in only:
                continue
            proof = Proof(key=key, title=title)
            report.proofs.append(proof)
            await one(proof, run, Proving(proof, goals=gpu and not quick), sizes, deadline)
            print(f"{title}: {'passed' if proof.passed else 'FAILED'} in {proof.seconds:.0f} s",
                  flush=True)  # fmt: skip
            if not proof.passed:
                failed = True
                await cancel_all(up)
    except asyncio.CancelledError:  # SIGTERM: stop here, the stack too, and say so
        me.uncancel()
        failed = True
        report.proofs.append(Proof(key="stopped", title="stopped", error="SIGTERM"))
    except Exception as exc:
        failed = True
        report.proofs.append(Proof(key="stack", title="baton up", error=f"{exc!r}"))
    finally:
        if failed or not report.passed:
            (out / "gpu-logs.txt").write_text(up.log_tails())
        report.leftovers = await up.stop()
        report.audit = [f"{f.log}: {f.line[:300]}" for f in Audit(up.data).findings()]
        report.seconds = time.monotonic() - began
        report.write(out)
        shutil.rmtree(root, ignore_errors=True)
    return report


async def one(proof: Proof, run: Run, p: Proving, sizes: Sizes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left < MIN_LEFT_S:
        proof.error = "not run: the budget was spent"
        return
    limit = min(sizes.limits_s[proof.key], left)
    began = time.monotonic()
    try:
        async with asyncio.timeout(limit):
            await run(p, began + limit)
    except TimeoutError:
        proof.error = f"over its limit of {limit:.0f} s"
    except asyncio.CancelledError:
        proof.error = "stopped (SIGTERM) before it was done"
        raise
    except Exception as exc:
        proof.error = f"{type(exc).__name__}: {exc}"
    finally:
        proof.seconds = time.monotonic() - began


async def cancel_all(up: Up) -> None:
    """After a failed proof: none of its runs may go on training beside the next one."""
    nc = up.nats()
    for rec in await client.all_records(nc):
        if not rec.state.terminal:
            try:
                await client.cancel(nc, rec.run_id, "the proof it belonged to failed")
            except Exception as exc:
                print(f"could not cancel {rec.run_id}: {exc!r}", file=sys.stderr)


def machine(env: dict[str, str]) -> dict[str, Any]:
    """The versions the figures were taken with: torch's (asked of a process of its own, so
    this one never loads CUDA), the GPU's and its driver's, nats-server's."""
    probe = (
        "import json, torch; b = torch.backends.cudnn; print(json.dumps({'torch': "
        "torch.__version__, 'cuda': torch.version.cuda, 'cudnn': b.version() if "
        "b.is_available() else None, 'gpus': torch.cuda.device_count()}))"
    )
    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        env={**os.environ, **env},
    )  # fmt: skip
    out.update(json.loads(found.stdout.strip().splitlines()[-1]))
    query = "--query-gpu=driver_version,memory.total,compute_mode,name"  # a name may hold ","
    gpus = device.smi(query) if not env else []
    if gpus:
        driver, mib, mode, *names = gpus[0]
        name = ",".join(names)
        # "Exclusive_Process" would keep the trainers from sharing the GPU.
        out.update(gpu=name, driver=driver, gpu_memory_mib=int(mib), compute_mode=mode)
        out["gpu_count"] = len(gpus)
    nats = shutil.which("nats-server")
    if nats:
        version = subprocess.run([nats, "--version"], capture_output=True, text=True)
        out["nats_server"] = version.stdout.strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/gpu")))
    ap.add_argument("--cpu", action="store_true", help="no GPU: the same code paths on CPUs")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (goals not judged)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    ap.add_argument("--only", default="", help="comma-separated proofs to run (all: empty)")
    ap.add_argument("--root", type=Path, help="scratch for the stack (default: a new one)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    root = a.root or Path(tempfile.mkdtemp(prefix="baton-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    only = {k.strip() for k in a.only.split(",") if k.strip()}
    report = asyncio.run(prove(a.out, root.absolute(), a.cpu, a.quick, a.budget, only))
    print(f"{'passed' if report.passed else 'FAILED'} in {report.seconds:.0f} s; "
          f"{a.out / 'gpu.json'}, {a.out / 'gpu.md'}")  # fmt: skip
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
