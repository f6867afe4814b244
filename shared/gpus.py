"""The NVIDIA GPUs of this host, as nvidia-smi lists them, and which of them a process may use.

Read from `nvidia-smi` rather than from torch: the trainer and `baton up` never import
torch (only training processes do), and nvidia-smi answers in milliseconds. A process is
pinned to a GPU by `CUDA_VISIBLE_DEVICES` naming the GPU's UUID, not its index: nvidia-smi
numbers GPUs in PCI bus order while CUDA, by default, numbers the fastest first, so an
index can name different GPUs to the two; a UUID names one GPU to both. A training process
pinned so sees its GPU as `cuda` (`cuda:0`), whatever its place on the host.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping

import msgspec

QUERY = "index,uuid,memory.total,name"
"""The name last: it is the one field that could hold a comma."""
VISIBLE = "CUDA_VISIBLE_DEVICES"


class Gpu(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    """nvidia-smi's index (PCI bus order), what operators see in `nvidia-smi`."""
    uuid: str
    name: str
    memory_bytes: int


def parse(csv: str) -> list[Gpu]:
    """nvidia-smi's `--query-gpu=QUERY --format=csv,noheader,nounits` output."""
    gpus = []
    for line in csv.splitlines():
        if not line.strip():
            continue
        index, uuid, mib, name = (p.strip() for p in line.split(",", 3))
        gpus.append(
            Gpu(index=int(index), uuid=uuid, name=name, memory_bytes=int(float(mib)) * 1024**2)
        )
    return gpus


def host_gpus(timeout_s: float = 10.0) -> list[Gpu]:
    """Every GPU nvidia-smi lists; none where it is missing or fails (no driver, no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=timeout_s, check=True,
        ).stdout  # fmt: skip
        return parse(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def visible(gpus: list[Gpu], env: Mapping[str, str]) -> list[Gpu]:
    """The GPUs `env`'s CUDA_VISIBLE_DEVICES lets a process use, in its order. As CUDA reads
    it: unset is all of them, empty is none, entries are indexes or (prefixes of) UUIDs, and
    the list ends at the first entry that names no GPU."""
    if VISIBLE not in env:
        return list(gpus)
    out: list[Gpu] = []
    for entry in (e.strip() for e in env[VISIBLE].split(",")):
        found = [g for g in gpus if _names(entry, g)]
        if len(found) != 1 or found[0] in out:
            break
        out.append(found[0])
    return out


def _names(entry: str, gpu: Gpu) -> bool:
    if entry.isdigit():
        return int(entry) == gpu.index
    return entry.startswith("GPU-") and gpu.uuid.startswith(entry)


def pin(gpu: Gpu) -> dict[str, str]:
    """The environment that pins a process to `gpu`."""
    return {VISIBLE: gpu.uuid}
