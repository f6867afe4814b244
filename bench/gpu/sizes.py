"""How big each proof is: full size on a GPU, tiny with `--quick` (the same code paths)."""

from __future__ import annotations

from typing import Any

import msgspec


class Gpt(msgspec.Struct, frozen=True, kw_only=True):
    """A GPT's shape and its training batch (`bench.gpu.models`)."""

    vocab: int
    seq: int
    width: int
    layers: int
    heads: int
    batch: int
    windows: int
    """Windows in the data set: the loader reshuffles them every epoch."""
    dropout: float = 0.1
    lr: float = 3e-4

    def config(self, **more: Any) -> dict[str, Any]:
        """As a job's `config`."""
        return {**msgspec.structs.asdict(self), **more}


class Llama(msgspec.Struct, frozen=True, kw_only=True):
    vocab: int
    seq: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    batch: int
    windows: int

    def config(self, **more: Any) -> dict[str, Any]:
        return {**msgspec.structs.asdict(self), **more}


class Sizes(msgspec.Struct, frozen=True, kw_only=True):
    exact: Gpt
    exact_steps: int
    exact_every: int
    hold_mib: int
    """GPU memory the zygote proof's training process holds when its trainer is killed."""
    cost: Gpt
    cost_steps: int
    rate: Gpt
    rate_warm: int
    rate_seconds: float
    """How long the bare loop runs after its warm-up: it sets the steps both runs take."""
    rate_every_s: float
    """The run under Baton checkpoints this often, as a run of that size would."""
    llama: Llama
    llama_steps: int
    llama_every: int
    limits_s: dict[str, float]
    """Each proof's own time limit."""


FULL = Sizes(
    exact=Gpt(vocab=16384, seq=256, width=768, layers=12, heads=12, batch=16, windows=4096),
    exact_steps=160,
    exact_every=40,
    hold_mib=8192,
    cost=Gpt(vocab=32768, seq=512, width=2048, layers=18, heads=16, batch=4, windows=1024),
    cost_steps=8,
    rate=Gpt(vocab=16384, seq=256, width=768, layers=12, heads=12, batch=16, windows=4096),
    rate_warm=20,
    rate_seconds=30.0,
    rate_every_s=10.0,
    llama=Llama(
        vocab=8192,
        seq=256,
        hidden=512,
        intermediate=1408,
        layers=6,
        heads=8,
        batch=16,
        windows=2048,
    ),
    llama_steps=60,
    llama_every=20,
    limits_s={"zygote": 90, "exact": 150, "framework": 150, "cost": 180, "overhead": 150},
)

QUICK = Sizes(
    exact=Gpt(vocab=128, seq=32, width=32, layers=2, heads=2, batch=4, windows=256, lr=3e-3),
    exact_steps=120,
    exact_every=20,
    hold_mib=64,
    cost=Gpt(vocab=256, seq=64, width=256, layers=4, heads=4, batch=4, windows=64),
    cost_steps=8,
    rate=Gpt(vocab=128, seq=32, width=64, layers=2, heads=2, batch=8, windows=2048),
    rate_warm=5,
    rate_seconds=3.0,
    rate_every_s=1.0,
    llama=Llama(
        vocab=128, seq=32, hidden=32, intermediate=64, layers=2, heads=2, batch=4, windows=256
    ),
    llama_steps=30,
    llama_every=10,
    # Seconds at tiny sizes are mostly imports and process starts: a loaded machine's.
    limits_s={"zygote": 90, "exact": 180, "framework": 180, "cost": 90, "overhead": 120},
)
