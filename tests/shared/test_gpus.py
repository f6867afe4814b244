"""Which GPUs a process may use, read as CUDA reads `CUDA_VISIBLE_DEVICES`, from what
nvidia-smi prints; and `baton up` spreading its trainers over them, one GPU each."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.stack.options import CPU_TRAINERS, StackOptions
from baton.stack.services import service_specs
from shared import gpus

# nvidia-smi --query-gpu=index,uuid,memory.total,name --format=csv,noheader,nounits, on a
# host with four GPUs (the name is last and may hold a comma).
SMI = """\
0, GPU-5f3c8a2e-1b7d-4c1e-9a51-0c2b6d3e8f41, 81559, NVIDIA H100 80GB HBM3
1, GPU-a0d1e2f3-4455-6677-8899-aabbccddeeff, 81559, NVIDIA H100 80GB HBM3
2, GPU-0badf00d-0000-1111-2222-333344445555, 24564, NVIDIA GeForce RTX 4090, rev. A
3, GPU-a0d1ffff-0000-0000-0000-000000000000, 24564, NVIDIA GeForce RTX 4090

"""
HOST = gpus.parse(SMI)


def test_nvidia_smi_lines_are_read_whole() -> None:
    assert [g.index for g in HOST] == [0, 1, 2, 3]
    assert HOST[0].uuid == "GPU-5f3c8a2e-1b7d-4c1e-9a51-0c2b6d3e8f41"
    assert HOST[0].memory_bytes == 81559 * 1024**2
    assert HOST[2].name == "NVIDIA GeForce RTX 4090, rev. A"


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, [0, 1, 2, 3]),  # unset: every GPU
        ("", []),  # empty: none
        ("2,0", [2, 0]),  # in the order given
        ("GPU-0badf00d", [2]),  # a unique prefix of a UUID
        ("GPU-a0d1", []),  # a prefix two UUIDs share names neither
        ("1,7,2", [1]),  # the list ends at an entry that names no GPU
        ("-1", []),
        ("0,0", [0]),  # a GPU named twice: taken as the end of the list
    ],
)
def test_cuda_visible_devices_as_cuda_reads_it(value: str | None, want: list[int]) -> None:
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert [g.index for g in gpus.visible(HOST, env)] == want


def trainer_env(opts: StackOptions) -> dict[str, str | None]:
    return {
        s.name: s.env.get("CUDA_VISIBLE_DEVICES")
        for s in service_specs(opts, "nats://unused")
        if "trainer-" in s.name
    }


def test_baton_up_runs_one_trainer_per_gpu_each_pinned_by_uuid(tmp_path: Path) -> None:
    two = HOST[:2]
    opts = StackOptions(data_dir=tmp_path, auth=False, gpus=two)
    assert trainer_env(opts) == {"trainer-1": two[0].uuid, "trainer-2": two[1].uuid}
    # More trainers than GPUs: in turn. The other services are never pinned.
    more = StackOptions(data_dir=tmp_path, auth=False, gpus=two, trainers=3)
    assert list(trainer_env(more).values()) == [two[0].uuid, two[1].uuid, two[0].uuid]
    specs = service_specs(more, "nats://unused")
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs if "trainer-" not in s.name)
    # A site's trainers too.
    site = StackOptions(data_dir=tmp_path, auth=False, gpus=HOST, site="lab1", hub_url="ws://h")
    assert list(trainer_env(site)) == [f"lab1-trainer-{i}" for i in range(1, 5)]


def test_without_a_gpu_two_unpinned_trainers(tmp_path: Path) -> None:
    opts = StackOptions(data_dir=tmp_path, auth=False, gpus=[])
    assert trainer_env(opts) == {f"trainer-{i}": None for i in range(1, CPU_TRAINERS + 1)}
