"""What a job's `[tracking]` adds to a step, against the tracker's own client alone.

Each variant runs the same loop of `--steps` steps of a small model (one Linear forward,
backward, Adam step) reporting one metric per step, with a checkpoint every `--every`
steps committed to a `file://` store by the commit protocol as the trainer would (the
commit told back to the training side at once):

* `bare`: the loop, no Baton, no tracker;
* `<tracker> alone`: the loop, the tracker's client logging each step as a user would
  (TensorBoard: `SummaryWriter.add_scalar` + `flush`; MLflow: `MlflowClient.log_metric`;
  W&B, offline: `run.log`, and the run's `finish` at the end, timed, as Baton's is);
* `baton`: the loop under a `RunContext`, `ctx.report()` each step, no tracker;
* `baton + <tracker>`: the same with `[tracking]`: rows buffered, written per commit.

MLflow is reached through a SQLite tracking URI in the process (no server): what is
compared is the number and size of the client's writes, not a network. W&B runs offline
(its service process writes the run's file; no server).

    .venv/bin/python -m bench.tracking [--steps 2000] [--every 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from baton.runtime.context import RunContext
from baton.tracking import identity
from shared.checkpoint import commit
from shared.checkpoint.store.file import FileStore
from shared.contracts import CommitRequest, JobSpec, Task, convert
from shared.contracts.child import CheckpointReady, FromChild


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 1)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def step(net: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    x = torch.randn(32, 64)
    loss = net(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.item())


def bare(steps: int, log: Callable[[int, float], None] | None = None) -> float:
    net, opt = model()
    began = time.perf_counter()
    for i in range(steps):
        value = step(net, opt, i)
        if log is not None:
            log(i, value)
    return (time.perf_counter() - began) / steps


def under_baton(root: Path, steps: int, every: int, tracking: dict[str, Any] | None) -> float:
    spec = convert(
        {"name": "bench", "entry_point": "m:f", "total_steps": steps,
         "checkpoint": {"every_steps": every}, **({"tracking": tracking} if tracking else {})},
        JobSpec,
    )  # fmt: skip
    store = FileStore(root / "store")
    holder: list[RunContext] = []
    if spec.tracking is not None:  # as the training process does before the entry point
        from baton.tracking.tracker import prepare

        prepare(spec.tracking, "bench", 0)

    def send(msg: FromChild) -> None:
        if isinstance(msg, CheckpointReady):
            req = CommitRequest(
                run_id="bench", token=msg.token, step=msg.step, worker="w", files=msg.files,
                final=msg.final, metrics=msg.metrics, digest=msg.digest,
            )  # fmt: skip
            asyncio.run(commit.commit(store, req))
            holder[0].request("committed", step=msg.step)

    ctx = RunContext(Task(run_id="bench", spec=spec), 1, f"file://{root / 'store'}",
                     root / "spool", send)  # fmt: skip
    holder.append(ctx)
    net, opt = model()
    ctx.restore(model=net, optimizer=opt)
    began = time.perf_counter()
    for i in ctx.steps():
        ctx.report(loss=step(net, opt, i))
    ctx.close()
    took = (time.perf_counter() - began) / steps
    if spec.tracking is not None:
        # What the training process's environment was, and W&B's process-wide settings,
        # which it read from that environment: gone with the process, as after an attempt.
        for name in identity.environment(spec.tracking, "bench", None):
            os.environ.pop(name, None)
        if spec.tracking.kind == "wandb":
            import wandb

            wandb.teardown()
    return took


def tensorboard_alone(root: Path, steps: int) -> float:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(root / "tb-alone"))

    def log(i: int, value: float) -> None:
        writer.add_scalar("loss", value, i)
        writer.flush()

    try:
        return bare(steps, log)
    finally:
        writer.close()


def mlflow_alone(uri: str, name: str, steps: int) -> float:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment(name)
    run = client.create_run(experiment).info.run_id
    return bare(steps, lambda i, value: client.log_metric(run, "loss", value, step=i))


def wandb_alone(root: Path, steps: int) -> float:
    import wandb

    run = wandb.init(project="bench", mode="offline", dir=str(root), reinit="create_new")
    began = time.perf_counter()
    bare(steps, lambda i, value: run.log({"loss": value}, step=i))
    run.finish()
    took = (time.perf_counter() - began) / steps
    wandb.teardown()  # its settings are the process's: not the next variant's
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["WANDB_SILENT"] = "true"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments()  # its schema made, not timed
        variants: list[tuple[str, Callable[[Path], float]]] = [
            ("bare", lambda d: bare(args.steps)),
            ("tensorboard alone", lambda d: tensorboard_alone(d, args.steps)),
            ("mlflow alone", lambda d: mlflow_alone(uri, d.name, args.steps)),
            ("baton", lambda d: under_baton(d, args.steps, args.every, None)),
            ("baton + tensorboard", lambda d: under_baton(
                d, args.steps, args.every, {"kind": "tensorboard", "dir": str(d / "tb")})),
            ("baton + mlflow", lambda d: under_baton(
                d, args.steps, args.every, {"kind": "mlflow", "uri": uri, "project": d.name})),
            ("wandb alone", lambda d: wandb_alone(d, args.steps)),
            ("baton + wandb", lambda d: under_baton(d, args.steps, args.every,
                {"kind": "wandb", "mode": "offline", "dir": str(d), "project": "bench"})),
        ]  # fmt: skip
        rows = [
            (name, statistics.median(run(root / f"{i}-{r}") for r in range(args.repeats)))
            for i, (name, run) in enumerate(variants)
        ]
    print(f"{args.steps} steps, a checkpoint every {args.every}, median of {args.repeats}")
    print("| variant | per step | added to its baseline |")
    print("| --- | --- | --- |")
    base = dict(rows)
    for name, per in rows:
        ref = base["baton"] if name.startswith("baton +") else base["bare"]
        added = "" if name in ("bare", "baton") else f"{(per - ref) * 1e6:+.0f} µs"
        print(f"| {name} | {per * 1e6:.0f} µs | {added} |")


if __name__ == "__main__":
    main()
