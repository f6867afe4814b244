"""`baton demo`: the quickstart's main job, and Baton's promise shown on one machine.

It starts the embedded stack, trains the example job, SIGKILLs the trainer that holds it
part-way through, lets the run finish on another trainer from its last committed
checkpoint, trains the same job again without interruption, and prints both weight digests
side by side: with deterministic mode on they are bitwise identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
from nats.aio.client import Client
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

from baton.cli.watch import describe
from baton.client import calls as client
from baton.client.errors import CliError
from shared import credentials
from shared.contracts import JobSpec
from shared.contracts.events import Completed, Event, Failed, Started
from shared.contracts.events import Progress as ProgressEvent

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "job.toml"
KILL_AT = 0.4
LEASE_TTL_S = 4
STACK_START_S = 60.0
RUN_DEADLINE_S = 300.0


async def run_demo(console: Console, keep: bool) -> int:
    data = Path(tempfile.mkdtemp(prefix="baton-demo-"))
    console.print(
        f"[bold]Starting the embedded stack[/bold] in {data} (2 trainers, lease TTL {LEASE_TTL_S}s)"
    )
    stack_log = (data / "up.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton",
        "up",
        "--data-dir",
        str(data),
        "--port",
        "0",
        "--trainers",
        "2",
        "--lease-ttl",
        str(LEASE_TTL_S),
        "--ws-port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=stack_log,
    )
    started = time.monotonic()
    try:
        url = await _nats_url(proc)
        console.print(f"nats: {url}")
        operator = credentials.read_env_file(data / "auth" / "operator.env")
        nc = await client.open_nats(url, **credentials.options_for(operator))
        try:
            return await _demo(console, nc, data, started)
        finally:
            await nc.close()
    finally:
        await _stop(proc)
        stack_log.close()
        console.print("stack stopped; every process it started has exited")
        if not keep:
            shutil.rmtree(data, ignore_errors=True)


async def _demo(console: Console, nc: Client, data: Path, started: float) -> int:
    spec = client.load_spec(EXAMPLE)
    await client.wait_for_services(nc, spec.pool, STACK_START_S)
    survivor, _ = await client.submit(nc, _keyed(spec, "survivor"), 10)
    console.print(
        f"submitted {spec.name} as run [bold]{survivor}[/bold] ({spec.total_steps} steps)"
    )
    with Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        TextColumn("{task.completed:>4}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"),
        console=console,
    ) as bars:
        lines: asyncio.Queue[tuple[str, Event]] = asyncio.Queue()
        bar_s = bars.add_task("interrupted run", total=spec.total_steps, loss="-")
        followers = [asyncio.create_task(_follow(nc, survivor, lines))]
        killed = False
        reference: str | None = None
        bar_r: TaskID | None = None
        holder = ""
        results: dict[str, Completed] = {}
        first_loss: dict[str, float] = {}
        deadline = time.monotonic() + RUN_DEADLINE_S
        try:
            while len(results) < 2:
                run_id, event = await asyncio.wait_for(
                    lines.get(), max(1.0, deadline - time.monotonic())
                )
                bar = bar_s if run_id == survivor else bar_r
                assert bar is not None
                if isinstance(event, Started) and run_id == survivor:
                    holder = event.worker
                if isinstance(event, ProgressEvent):
                    first_loss.setdefault(run_id, event.metrics.get("loss", 0.0))
                    bars.update(
                        bar, completed=event.step, loss=f"{event.metrics.get('loss', 0):.4f}"
                    )
                    if (
                        run_id == survivor
                        and not killed
                        and event.step >= spec.total_steps * KILL_AT
                    ):
                        pid = int((data / "run" / f"{holder}.pid").read_text())
                        os.kill(pid, signal.SIGKILL)
                        killed = True
                        bars.console.print(
                            f"[red]SIGKILL[/red] {holder} (pid {pid}) at step {event.step}: "
                            "its training process dies with it"
                        )
                        reference, _ = await client.submit(nc, _keyed(spec, "reference"), 10)
                        bar_r = bars.add_task("uninterrupted run", total=spec.total_steps, loss="-")
                        followers.append(asyncio.create_task(_follow(nc, reference, lines)))
                elif isinstance(event, Completed):
                    bars.update(bar, completed=event.step)
                    results[run_id] = event
                elif isinstance(event, Failed):
                    raise CliError(f"run {run_id} failed: {event.reason}")
                if (line := describe(event)) is not None:
                    bars.console.print(f"[dim]{run_id[:8]}[/dim] {line}")
        finally:
            for f in followers:
                f.cancel()
    assert reference is not None
    out_dir = Path("out") / survivor
    pulled = await client.pull(f"file://{data / 'store'}", survivor, out_dir)
    a, b = results[survivor], results[reference]
    same = a.digest == b.digest == pulled["digest"]
    table = Table(title="Baton demo", show_header=True)
    table.add_column("")
    table.add_column("killed mid-run, resumed")
    table.add_column("uninterrupted")
    table.add_row("run", survivor, reference)
    table.add_row(
        "first loss", f"{first_loss.get(survivor, 0):.6f}", f"{first_loss.get(reference, 0):.6f}"
    )
    table.add_row(
        "final loss", f"{a.metrics.get('loss', 0):.6f}", f"{b.metrics.get('loss', 0):.6f}"
    )
    console.print(table)
    console.print(f"weights digest, killed and resumed: {a.digest}")
    console.print(f"weights digest, uninterrupted:      {b.digest}")
    console.print(f"pulled and verified the resumed run's checkpoint into {out_dir}/")
    console.print(
        "[green bold]bitwise identical[/green bold]"
        if same
        else "[red bold]DIGESTS DIFFER[/red bold]",
        f"— total time {time.monotonic() - started:.1f}s",
    )
    return 0 if same else 1


def _keyed(spec: JobSpec, role: str) -> JobSpec:
    return msgspec.structs.replace(spec, idempotency_key=f"demo-{role}-{uuid.uuid4().hex[:12]}")


async def _follow(nc: Client, run_id: str, lines: asyncio.Queue[tuple[str, Event]]) -> None:
    async for event in client.events(nc, run_id):
        await lines.put((run_id, event))


async def _nats_url(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + STACK_START_S
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())
        if not line:
            break
        if line.startswith(b"nats: "):
            return line.decode().split(" ", 1)[1].strip()
    raise CliError("the stack did not start; see up.log in the demo's data directory (--keep)")


async def _stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
