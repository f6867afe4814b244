"""`tests.support.workloads:paced` as a torchrun worker, for bench/recovery.py: the same
model, batches and optimizer, a checkpoint (`torch.save`) every `--every` steps into `--dir`,
resumed from the newest one there, as such a script under `torchrun --max-restarts` is
written. Each step appends `<time.time()> <step> <pid>` to `--step-log` (bench/torchrun.py),
and two marks: the script began (step -1, before its imports) and its loop began (step 0).

    python -m torch.distributed.run --nproc-per-node 1 --max-restarts 1 \\
        bench/paced_torchrun.py --dir CKPT --step-log STEPS.txt [--steps 400 --every 20]
"""

from __future__ import annotations

import time

BEGAN = time.time()

import argparse  # noqa: E402 - after the time the script began
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# Run as a script (torchrun's way): the repository root, for `examples`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from examples.regression import make_batch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--step-log", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--pace", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    log = open(a.step_log, "a", buffering=1)  # noqa: SIM115 - open for the whole run
    pid = os.getpid()
    log.write(f"{BEGAN:.6f} -1 {pid}\n")
    torch.manual_seed(a.seed)
    dim, hidden, batch = 16, 32, 32
    model = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ckpts = Path(a.dir)
    ckpts.mkdir(parents=True, exist_ok=True)
    start = 0
    saved = sorted(ckpts.glob("step-*.pt"))
    if saved:
        state = torch.load(saved[-1])
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
    log.write(f"{time.time():.6f} 0 {pid}\n")
    for step in range(start, a.steps):
        x, y = make_batch(a.seed, step, batch, dim)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"{time.time():.6f} {step + 1} {pid}\n")
        if (step + 1) % a.every == 0:
            state = {
                "model": model.state_dict(), "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state(), "step": step + 1,
            }  # fmt: skip
            tmp = ckpts / f".step-{step + 1:08d}.pt"
            torch.save(state, tmp)
            tmp.rename(ckpts / f"step-{step + 1:08d}.pt")
        time.sleep(a.pace)


if __name__ == "__main__":
    main()
