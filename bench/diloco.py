"""Replicated (DiLoCo) runs (docs/diloco.md): bytes per round, loss against compute, and
the utilisation of the replicas still meeting while a site is cut off.

    .venv/bin/python -m bench.diloco [--part bytes,loss,utilisation] [--steps 1500]
                                     [--replicas 3] [--cut-rounds 6]

**Bytes.** Three replicas (`baton.runtime.replica`, threads of this process) of the
character LM at its example size (`examples/charlm.toml`: hidden 256) meet for two rounds
in a file store; every byte each sends and reads for a round is what its `round` notes
count. Against it, synchronous data parallelism over the same `H` steps: a ring
all-reduce of fp32 gradients sends and receives `2(n-1)/n · 4P` bytes per rank per step.

**Loss against compute.** The character LM (hidden 128), each of `n` replicas taking
`--steps` AdamW steps (cosine schedule, clipped at 1) of batch 16 on its own share of
the data, meeting every H steps by
the outer step the runtime applies (`rounds.mean_of`, `rounds.outer_step`: outer lr 0.7,
Nesterov momentum 0.9 — the paper's — and 0.5); against synchronous data parallelism at the same
compute (one model, batch `16n`, `--steps` steps). Loss is the mean over 32 fixed batches
of windows no run trains on.

**Utilisation.** The hub (one trainer) and site `lab1` (two trainers) as real processes
under `baton up`'s authorization, SeaweedFS as the store, the site's links to the hub and
to the store each behind a proxy. A 3-replica run of the character LM (`--inner` H = 100,
`--deadline` 1 s, `--pace` 30 ms slept a step); once round 5 is committed, both site links
are cut until the hub replica has joined `--cut-rounds` more rounds alone. Utilisation of
the hub replica over the cut is 1 − (its steps' time standing still for rounds, from its
`round` events' `waited_s`) / (the cut's length); the same over the rounds before the cut
(all three meeting) is the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from examples.charlm import CharGRU, dataset
from shared.checkpoint import rounds
from shared.contracts import JobSpec, Task
from shared.contracts.child import FromChild, RoundReached
from shared.contracts.jobs import Outer
from shared.contracts.records import replica_run_id
from shared.contracts.rounds import RoundNote

BATCH = 16


# -- bytes -----------------------------------------------------------------------------------


def measure_bytes(replicas: int, inner: int, precision: str) -> dict[str, float]:
    """Bytes of one round, all replicas together, measured; and sync DP's over `inner` steps."""
    from baton.runtime.replica import Replica

    ds = dataset({"window": 64, "stride": 4})
    job = msgspec.convert({
        "name": "b", "entry_point": "m:f", "total_steps": 2 * inner, "replicas": replicas,
        "outer": {"inner_steps": inner, "precision": precision, "round_deadline_s": 30},
    }, JobSpec)  # fmt: skip
    notes: list[RoundNote] = []
    lock = threading.Lock()

    def send(msg: FromChild) -> None:
        if isinstance(msg, RoundReached) and msg.note.outcome == "joined":
            with lock:
                notes.append(msg.note)

    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}"

        def one(i: int) -> int:
            spec = msgspec.structs.replace(job, replica=i)
            model = CharGRU(len(ds.vocab), 32, 256, 0.0)
            r = Replica(Task(run_id=replica_run_id("rbench", i), spec=spec), url, send, None)
            r.attach(model)
            with torch.no_grad():  # a change of every parameter, as after inner steps
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            r.boundary(inner, 1, final=False)
            return sum(p.numel() for p in model.parameters())

        sizes: list[int] = []
        threads = [
            threading.Thread(target=lambda i=i: sizes.append(one(i))) for i in range(replicas)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    params = sizes[0]
    moved = sum(n.sent_bytes + n.received_bytes for n in notes)
    ring = 2 * (replicas - 1) / replicas * 4 * params  # sent (and as much received) per rank
    dp = 2 * ring * replicas * inner
    return {"params": params, "diloco": moved, "dp": dp, "ratio": dp / moved,
            "sent_per_replica": moved / replicas}  # fmt: skip


# -- loss against compute --------------------------------------------------------------------


def _eval_batches(ds: Any, held: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(32):
        idx = held[k * BATCH : (k + 1) * BATCH]
        xs, ys = zip(*(ds[i] for i in idx), strict=True)
        out.append((torch.stack(xs), torch.stack(ys)))
    return out


def _loss(model: CharGRU, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
                    for x, y in batches)  # fmt: skip
    model.train()
    return total / len(batches)


def train_loss(steps: int, replicas: int, outer: Outer | None, seed: int = 0) -> float:
    """Final held-out loss of DiLoCo (`outer`) or of sync DP (`outer` None)."""
    ds = dataset({"window": 32, "stride": 4})
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
    held, train = order[: 32 * BATCH], order[32 * BATCH :]
    evals = _eval_batches(ds, held)

    def build() -> tuple[CharGRU, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = CharGRU(len(ds.vocab), 32, 128, 0.0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        schedules.append(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps))
        return model, opt

    schedules: list[torch.optim.lr_scheduler.LRScheduler] = []

    def batch(stream: list[int], step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        at = step * size % (len(stream) - size)
        xs, ys = zip(*(ds[i] for i in stream[at : at + size]), strict=True)
        return torch.stack(xs), torch.stack(ys)

    def step(model: CharGRU, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        next(s for s in schedules if s.optimizer is opt).step()

    if outer is None:  # sync DP: the replicas' batches as one
        model, opt = build()
        for s in range(steps):
            step(model, opt, *batch(train, s, BATCH * replicas))
        return _loss(model, evals)
    shares = [train[i::replicas] for i in range(replicas)]
    models = [build() for _ in range(replicas)]

    def inner_steps(start: int) -> None:
        for (model, opt), share in zip(models, shares, strict=True):
            for s in range(start, min(steps, start + outer.inner_steps)):
                step(model, opt, *batch(share, s, BATCH))

    _outer_rounds([m for m, _ in models], steps, outer, inner_steps)
    return _loss(models[0][0], evals)


def _outer_rounds(models: list[CharGRU], steps: int, outer: Outer, run: Any) -> None:
    """Every H steps (`run(start)` takes them), the outer step the runtime applies."""
    params = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum = {n: torch.zeros_like(t) for n, t in params.items()}
    for start in range(0, steps, outer.inner_steps):
        run(start)
        changes = [{n: params[n] - p.detach() for n, p in m.named_parameters()} for m in models]
        rounds.outer_step(params, momentum, rounds.mean_of(changes), outer)
        for m in models:
            with torch.no_grad():
                for n, p in m.named_parameters():
                    p.copy_(params[n])


# -- utilisation -----------------------------------------------------------------------------


async def utilisation(
    cut_rounds: int, inner: int, deadline: float, pace: float
) -> dict[str, float]:
    from shared.contracts.events import Round
    from tests.e2e.jobs import history, job, submit
    from tests.e2e.test_diloco import the_log
    from tests.support.proxy import Proxy
    from tests.support.seaweed import SeaweedS3
    from tests.support.sites import Site
    from tests.support.stack import Stack, eventually

    with SeaweedS3() as s3, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(s3.env())
        env = {**s3.env(), "BATON_STORE": s3.url(f"bench-{uuid.uuid4().hex[:8]}")}
        hub = Stack(Path(tmp) / "hub", trainers=0, lease_ttl=6, env=env)
        host, port = s3.endpoint.removeprefix("http://").rsplit(":", 1)
        store = Proxy(host, int(port))
        try:
            await hub.start(("dispatcher", "checkpointer", "reaper"))
            await store.start()
            site = Site(hub, "lab1", env={"BATON_S3_ENDPOINT": f"http://127.0.0.1:{store.port}"})
            await site.start(trainers=2)
            await hub.add_trainer("trainer-1")
            nc = await hub.client()
            spec = job(
                name="diloco-bench", entry_point="examples.charlm:train",
                total_steps=inner * (cut_rounds + 9),
                checkpoint={"every_steps": 25},
                config={"num_workers": 0, "window": 32, "stride": 8, "batch": 16, "embed": 16,
                        "hidden": 64, "dropout": 0.0, "lr": 0.01, "pace": pace},
                replicas=3, outer={"inner_steps": inner, "round_deadline_s": deadline},
            )  # fmt: skip
            run_id = await submit(nc, spec)
            await eventually(lambda: _rounds(the_log, hub, run_id, 5), 300, "five rounds")
            site.proxy.sever()
            store.sever()
            cut_at, before = time.time(), len(await the_log(hub, run_id))
            await eventually(lambda: _rounds(the_log, hub, run_id, before + cut_rounds), 600,
                             "rounds of the hub replica alone")  # fmt: skip
            healed_at = time.time()
            store.restore()
            site.proxy.restore()
            held = [(await _record(nc, run_id, i)).site for i in range(3)]
            hub_replica = held.index("")
            events = await history(nc, replica_run_id(run_id, hub_replica))
            notes = [(e.at, e.note) for e in events if isinstance(e, Round)]
            first = next(at for at, n in notes if n.outcome == "joined")
            waited_in = sum(n.waited_s for at, n in notes if cut_at <= at <= healed_at)
            waited_before = sum(n.waited_s for at, n in notes if first < at < cut_at)
            return {
                "cut_s": healed_at - cut_at, "rounds_in_cut": cut_rounds,
                "waited_cut_s": waited_in, "waited_before_s": waited_before,
                "before_s": cut_at - first,
                "utilisation_cut": 1 - waited_in / (healed_at - cut_at),
                "utilisation_before": 1 - waited_before / max(1e-9, cut_at - first),
            }  # fmt: skip
        finally:
            await hub.stop()
            await store.stop()


async def _rounds(the_log: Any, hub: Any, run_id: str, n: int) -> bool:
    return len(await the_log(hub, run_id)) >= n


async def _record(nc: Any, run_id: str, i: int) -> Any:
    from baton.client import calls as client

    return await client.record(nc, replica_run_id(run_id, i))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="bytes,loss,utilisation")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--cut-rounds", type=int, default=8)
    ap.add_argument("--inner", type=int, default=100, help="H of the utilisation run")
    ap.add_argument("--deadline", type=float, default=1.0, help="its round_deadline_s")
    ap.add_argument("--pace", type=float, default=0.03, help="seconds slept per step")
    args = ap.parse_args()
    parts = args.part.split(",")
    torch.set_num_threads(1)
    if "bytes" in parts:
        for precision in ("fp32", "bf16"):
            for h in (100, 500):
                b = measure_bytes(args.replicas, h, precision)
                print(f"bytes H={h} {precision}: {b['params']} params; a round moves "
                      f"{b['diloco'] / 1e6:.2f} MB, sync DP over the same steps "
                      f"{b['dp'] / 1e6:.1f} MB: {b['ratio']:.0f}x less", flush=True)  # fmt: skip
    if "loss" in parts:
        dp = train_loss(args.steps, args.replicas, None)
        print(f"loss sync DP (batch {BATCH * args.replicas}): {dp:.4f}", flush=True)
        for h in (50, 100, 500):
            for momentum in (0.9, 0.5):  # the paper's, and one this short run suits
                t = time.monotonic()
                outer = Outer(inner_steps=h, lr=0.7, momentum=momentum)
                got = train_loss(args.steps, args.replicas, outer)
                print(f"loss DiLoCo H={h} outer lr 0.7 Nesterov {momentum}: {got:.4f} "
                      f"({100 * (got / dp - 1):+.1f}% vs DP) [{time.monotonic() - t:.0f}s]",
                      flush=True)  # fmt: skip
    if "utilisation" in parts:
        u = asyncio.run(utilisation(args.cut_rounds, args.inner, args.deadline, args.pace))
        print(f"utilisation H={args.inner} deadline {args.deadline}s: cut {u['cut_s']:.1f}s for "
              f"{u['rounds_in_cut']} rounds, the hub replica waited {u['waited_cut_s']:.2f}s: "
              f"{100 * u['utilisation_cut']:.1f}% busy; before the cut, all three meeting, "
              f"{u['waited_before_s']:.2f}s of {u['before_s']:.1f}s: "
              f"{100 * u['utilisation_before']:.1f}%", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
