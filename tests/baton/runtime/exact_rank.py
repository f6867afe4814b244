"""One rank of a training run with `baton.runtime.exact.DataParallel`, as its own process
(started by `test_exact.py`, gloo on loopback): an MLP with dropout, AdamW and a cosine
schedule, trained from step `start` to `stop`, its state saved and loaded as safetensors.

    python -m tests.baton.runtime.exact_rank '{"rank": 0, "world": 2, "port": 1234, ...}'

Writes, as the JSON argument says: the final state (`save`, `{rank}` in it replaced), the
state after step `mid` (`mid_save`), and what this rank saw (`record`): the loss `sync()`
returned at each step, the dataset indices of each shard it computed, and whether the
caller's global RNG came out of every shard as it went in.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.utils.data import Dataset

from baton.runtime.exact import DataParallel

DIM, HIDDEN, CLASSES = 8, 32, 4


class Points(Dataset[tuple[Tensor, Tensor, Tensor]]):
    """`n` labelled points drawn from `seed`; each sample carries its own index."""

    def __init__(self, seed: int, n: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.randint(CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


def build(seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, CLASSES)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return model, opt, sched


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """Weights, optimizer state and schedule: tensors as safetensors, the rest as JSON in
    the file's metadata. No pickle."""
    tensors = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    state = opt.state_dict()
    for pid, per in state["state"].items():
        for k, v in per.items():
            tensors[f"opt.{pid}.{k}"] = v.contiguous()
    meta = {"param_groups": state["param_groups"], "sched": sched.state_dict()}
    save_file(tensors, path, metadata={"json": json.dumps(meta, sort_keys=True)})


def load(path: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    weights: dict[str, Tensor] = {}
    per: dict[int, dict[str, Tensor]] = {}
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["json"])
        for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            kind, rest = key.split(".", 1)
            if kind == "model":
                weights[rest] = f.get_tensor(key)
            else:
                pid, name = rest.split(".", 1)
                per.setdefault(int(pid), {})[name] = f.get_tensor(key)
    model.load_state_dict(weights)
    opt.load_state_dict({"state": per, "param_groups": meta["param_groups"]})
    sched.load_state_dict(meta["sched"])


def main(cfg: dict[str, Any]) -> None:
    # One thread, as a deterministic run's training process has. (Not
    # `use_deterministic_algorithms`: its first call takes 1.4 s here, and the CPU kernels
    # of this model are deterministic without it.)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    rank, world = int(cfg["rank"]), int(cfg["world"])
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
    seed, steps = int(cfg.get("seed", 3)), int(cfg.get("steps", 12))
    model, opt, sched = build(seed, steps)
    if cfg.get("load"):
        load(cfg["load"], model, opt, sched)
    dp = DataParallel(
        model, Points(seed, int(cfg.get("samples", 100))), batch_size=int(cfg.get("batch", 4)),
        shards=int(cfg.get("shards", 6)), seed=seed, rank=rank, world_size=world,
    )  # fmt: skip
    torch.manual_seed(1234 + rank)  # the caller's own RNG, which the shards must not touch
    losses: list[float] = []
    seen: dict[str, list[int]] = {}
    rng_kept = True
    for step in range(int(cfg.get("start", 0)), int(cfg.get("stop", steps))):
        for shard in dp.shards(step):
            x, y, idx = shard.batch
            seen[f"{step}/{shard.index}"] = idx.tolist()
            x = x + 0.05 * torch.randn(x.shape, generator=shard.generator)
            shard.backward(nn.functional.cross_entropy(model(x), y))  # dropout: global RNG
        caller = torch.get_rng_state()
        losses.append(dp.sync())
        rng_kept &= torch.equal(caller, torch.get_rng_state())
        opt.step()
        sched.step()
        if step + 1 == cfg.get("mid"):
            save(cfg["mid_save"].format(rank=rank), model, opt, sched)
    rng_kept &= torch.equal(torch.get_rng_state(), _seeded(1234 + rank))
    if cfg.get("save"):
        save(cfg["save"].format(rank=rank), model, opt, sched)
    if cfg.get("record"):
        record = {"losses": losses, "seen": seen, "rng_kept": rng_kept}
        with open(cfg["record"].format(rank=rank), "w") as out:
            json.dump(record, out)
    if world > 1:
        dist.destroy_process_group()


def _seeded(seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return g.get_state()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
