"""The proofs' model and data: a GPT as such models are usually written, and token windows
that a model can learn (each window's second half repeats its first).

The model takes the paths a GPU run takes: matrix products (cuBLAS), attention through
`scaled_dot_product_attention` (flash attention, deterministic in its backward pass under
deterministic algorithms), a causal convolution over the embeddings (cuDNN), dropout
(CUDA's generator, whose state a checkpoint must carry), all under bf16 autocast with fp32
weights and AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from bench.gpu.sizes import Gpt as Shape

Batch = tuple[Tensor, Tensor]


class Tokens(Dataset[Batch]):
    """`windows` windows of `seq + 1` tokens (input and target, shifted by one), drawn from
    `seed`: a random first half, repeated."""

    def __init__(self, vocab: int, seq: int, windows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(vocab, (windows, (seq + 2) // 2), generator=g)
        self.data = torch.cat([half, half], dim=1)[:, : seq + 1].contiguous()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Batch:
        return self.data[i, :-1], self.data[i, 1:]


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, w)))
        out: Tensor = x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))
        return out


class Gpt(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.width)
        self.pos = nn.Embedding(shape.seq, shape.width)
        # Causal: padded by kernel - 1 on both sides, the right side cut off.
        self.mix = nn.Conv1d(shape.width, shape.width, kernel_size=3, padding=2)
        self.blocks = nn.ModuleList(
            Block(shape.width, shape.heads, shape.dropout) for _ in range(shape.layers)
        )
        self.ln = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        x = x + self.mix(x.transpose(1, 2))[..., :t].transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(self.ln(x))
        return out


def shape_of(config: dict[str, Any]) -> Shape:
    """A job's `config` (`sizes.Gpt.config`) back as the model's shape."""
    fields = {f for f in Shape.__struct_fields__}
    return Shape(**{k: v for k, v in config.items() if k in fields})


def build(shape: Shape, seed: int, device: torch.device) -> tuple[Gpt, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Gpt(shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def train_step(
    model: Gpt, opt: torch.optim.Optimizer, batch: Batch, device: torch.device
) -> Tensor:
    """One step: forward under bf16 autocast, fp32 loss, clipped gradients, AdamW."""
    x, y = (t.to(device, non_blocking=True) for t in batch)
    model.train()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
