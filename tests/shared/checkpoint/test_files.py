"""Checkpoint files from a hostile or broken store are refused with an error that names the
problem: bad names and keys, bad safetensors headers, tensors that differ from meta.json or
from the object they would be loaded into. Real files, real safetensors, real torch, the
real commit protocol on a file store, and the real RunContext restore path.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save, save_file

from baton.runtime.context import RunContext
from baton.runtime.load import download
from shared.checkpoint import commit
from shared.checkpoint import files as checkpoint_files
from shared.checkpoint.files import ITEMSIZE, TensorSpec
from shared.checkpoint.store.file import FileStore
from shared.checkpoint.tensors import DTYPES
from shared.contracts import CommitRequest, FileRef, JobSpec, Manifest, Pointer, Task, encode
from shared.contracts.child import CheckpointReady, FromChild
from shared.errors import ContractError, IntegrityError

RUN = "r1"
SPEC = JobSpec(name="t", entry_point="m:f", total_steps=10)


def refused(what: Callable[[], object], *needles: str) -> IntegrityError:
    try:
        what()
    except IntegrityError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in the error: {exc}"
        return exc
    raise AssertionError(f"accepted; expected a refusal naming {needles}")


def raw(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file as bytes, with any header (a dict is JSON-encoded) and length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def write(tmp_path: Path, data: bytes, name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


GOOD_HEADER = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


# -- headers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        (b"\x01\x02", ["2 bytes, too short"]),
        (raw(GOOD_HEADER, bytes(16), length=2**62), ["header length", "over the limit"]),
        (raw(GOOD_HEADER, bytes(16), length=10_000), ["header length 10000", "past the end"]),
        (raw(GOOD_HEADER, bytes(16))[:-5], ["tensors cover 16 bytes", "the file has 11"]),
        (raw(b"not json at all"), ["not a JSON object"]),
        (raw(b'{"w": '), ["not a JSON object"]),
        (raw(b"[1, 2]"), ["not a JSON object"]),
        (raw(b'{"a": NaN}'), ["not a JSON object", "NaN"]),
        (raw(b'{"w": {}, "w": {}}'), ["twice"]),
        (raw(b'{"w": "\xff\xfe"}'), ["not a JSON object"]),
        (raw({"w": {"dtype": "F32", "shape": [2, 2]}}, bytes(16)), ["'w'", "data_offsets"]),
        (
            raw({"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 32]}}, bytes(32)),
            ["'w'", "unknown dtype 'F128'"],
        ),
        (
            raw({"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, bytes(16)),
            ["'w'", "shape", "[-2, 2]"],
        ),
        (
            raw({"w": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}}, bytes(16)),
            ["'w'", "shape"],
        ),
        (
            raw({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16)),
            ["'w'", "F32[2, 2] (16 bytes)", "span 12"],
        ),
        (
            raw({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}, bytes(24)),
            ["'w'", "starts at byte 8", "expected 0"],
        ),
        (
            raw({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(20)),
            ["cover 16 bytes", "has 20"],
        ),
        (
            raw({"w": {"dtype": "U8", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}),
            ["'w'", "too many elements"],
        ),
        (
            raw({"__metadata__": {"a": 1}, **GOOD_HEADER}, bytes(16)),
            ["__metadata__"],
        ),
    ],
)
def test_a_bad_header_is_refused_naming_the_problem(
    tmp_path: Path, data: bytes, needles: list[str]
) -> None:
    path = write(tmp_path, data)
    refused(lambda: checkpoint_files.read_header(path), "model.safetensors", *needles)
    refused(lambda: checkpoint_files.load_tensors(path, "model.safetensors"), *needles)


def test_a_file_written_by_safetensors_passes_with_its_dtypes_and_shapes(tmp_path: Path) -> None:
    assert set(DTYPES) == set(ITEMSIZE), set(DTYPES) ^ set(ITEMSIZE)
    tensors = {
        f"t.{name}": torch.zeros((2, 3) if i % 2 else (4,), dtype=dtype)
        for i, (name, dtype) in enumerate(DTYPES.items())
    }
    tensors["empty"] = torch.zeros((0, 5))
    tensors["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    found = checkpoint_files.read_header(path)
    assert found["empty"] == TensorSpec("F32", (0, 5)), found["empty"]
    assert found["scalar"] == TensorSpec("F64", ()), found["scalar"]
    assert set(found) == set(tensors), set(found) ^ set(tensors)
    for name, spec in found.items():
        assert DTYPES[spec.dtype] == tensors[name].dtype, (name, spec)
        assert DTYPES[spec.dtype].itemsize == ITEMSIZE[spec.dtype], spec
    loaded = checkpoint_files.load_tensors(path, "model.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items()), "round trip differs"


# -- names and keys -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../x", "is a path"),
        ("/etc/passwd", "absolute path"),
        ("\\\\server\\share.safetensors", "absolute path"),
        ("C:model.safetensors", "absolute path"),
        ("a/b.safetensors", "is a path"),
        ("a\\b.safetensors", "is a path"),
        ("meta.json\x00", "control character"),
        ("model\n.safetensors", "control character"),
        ("..", "starts with a dot"),
        (".safetensors", "starts with a dot"),
        ("", "is empty"),
        ("m" * 200 + ".safetensors", "longer than 128"),
        ("model.pt", "neither meta.json, <group>.safetensors nor file.<name>"),
        ("meta.json.safetensors", "neither"),
        ("mod\u00e8le.safetensors", "neither"),
        # A rank's shard: rank<k>. (k >= 1, no leading zero) before a plain name, once.
        ("rank0.meta.json", "neither"),
        ("rank01.meta.json", "neither"),
        ("rank1.", "neither"),
        ("rank1.model.pt", "neither"),
        ("rank1.rank1.meta.json", "neither"),
        ("rank-1.meta.json", "neither"),
        ("Rank1.meta.json", "neither"),
    ],
)
def test_a_file_name_that_is_not_a_plain_checkpoint_name_is_refused(
    name: str, problem: str
) -> None:
    refused(lambda: checkpoint_files.check_name(name), repr(name), problem)


def test_checkpoint_file_names_pass() -> None:
    for name in ("meta.json", "model.safetensors", "rng.safetensors", "lr_sched-2.safetensors",
                 "rank1.meta.json", "rank12.rng.safetensors", "rank3.data.safetensors",
                 "rank1.safetensors"):  # fmt: skip
        assert checkpoint_files.check_name(name) == name, name
    ranks = {"meta.json": 0, "rank1.safetensors": 0, "rank1.meta.json": 1,
             "rank12.rank1.safetensors": 12}  # fmt: skip
    assert {n: checkpoint_files.rank_of(n) for n in ranks} == ranks


def test_a_frameworks_own_files_are_named_after_file_and_kept_opaque() -> None:
    """`baton.runtime.external`: a framework's files keep their names after `file.`."""
    names = {"file.optimizer.pt": "optimizer.pt", "file.trainer_state.json":
             "trainer_state.json", "rank1.file.random_states_1.pkl": "random_states_1.pkl",
             "file.model.safetensors": "model.safetensors"}  # fmt: skip
    for name, own in names.items():
        assert checkpoint_files.check_name(name) == name
        assert checkpoint_files.foreign_name(name) == own
    assert checkpoint_files.rank_of("rank1.file.random_states_1.pkl") == 1
    assert not checkpoint_files.is_tensor_file("file.model.safetensors")
    assert checkpoint_files.is_tensor_file("model.safetensors")
    assert checkpoint_files.foreign_name("model.safetensors") is None
    for bad in ("file.", "file..hidden", "file.a/b", "file.-x", "files.x"):
        with pytest.raises(IntegrityError):
            checkpoint_files.check_name(bad)


def ref(name: str, key: str, data: bytes = b"") -> FileRef:
    # Built directly, as a buggy or hostile writer could: msgspec checks names on decode only.
    return FileRef(name=name, key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize(
    ("refs", "needles"),
    [
        ([ref("model.safetensors", commit.data_key("other", 1, 10, "model.safetensors"))],
         ["runs/other/data/", "not under this checkpoint's prefix", f"runs/{RUN}/data/"]),
        ([ref("model.safetensors",
              commit.data_key(RUN, 1, 10, "../../../../other/data/x/model.safetensors"))],
         ["not under this checkpoint's prefix"]),
        ([ref("../x", commit.data_key(RUN, 1, 10, "../x"))], ["'../x'", "is a path"]),
        ([ref("/etc/passwd", "/etc/passwd")], ["absolute path"]),
        ([ref("meta.json\x00", commit.data_key(RUN, 1, 10, "meta.json\x00"))], ["control"]),
        ([ref("meta.json", commit.data_key(RUN, 1, 10, "meta.json"))] * 2, ["listed twice"]),
        ([], ["at least one file"]),
    ],
)  # fmt: skip
async def test_a_commit_naming_files_it_may_not_is_refused(
    tmp_path: Path, refs: list[FileRef], needles: list[str]
) -> None:
    store = FileStore(tmp_path)
    req = CommitRequest(run_id=RUN, token=1, step=10, worker="w", files=refs)
    try:
        await commit.commit(store, req)
        raise AssertionError("the commit was accepted")
    except ContractError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
    assert await commit.read_latest(store, RUN) is None, "a refused commit moved latest"


async def put(store: FileStore, token: int, step: int, name: str, data: bytes) -> FileRef:
    key = commit.data_key(RUN, token, step, name)
    await store.put_once(key, data)
    return ref(name, key, data)


async def test_a_commit_of_a_file_with_a_bad_header_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    bad = await put(store, 1, 10, "model.safetensors", raw(GOOD_HEADER, bytes(16), 2**40))
    req = CommitRequest(run_id=RUN, token=1, step=10, worker="w", files=[bad])
    with pytest.raises(IntegrityError, match=r"model\.safetensors: header length .* limit"):
        await commit.commit(store, req)
    assert await commit.read_latest(store, RUN) is None, "a refused commit moved latest"


async def forge(store: FileStore, step: int, files: list[FileRef], run_id: str = RUN) -> None:
    """A committed checkpoint that today's commit would refuse: one committed before these
    checks existed, or written by someone who can write to the store."""
    current = await commit.read_latest(store, RUN)
    manifest = Manifest(
        run_id=run_id, token=1, step=step, worker="w", files=files, final=False, metrics={},
        digest="", previous=current[0].manifest if current else None, created_at=0.0,
    )  # fmt: skip
    key = commit.manifest_key(RUN, step, 1)
    await store.put_once(key, encode(manifest))
    pointer = Pointer(run_id=RUN, token=1, step=step, manifest=key)
    version = current[1] if current else None
    await store.write_pointer(commit.latest_key(RUN), encode(pointer), version)


async def test_restore_walks_back_past_checkpoints_it_refuses(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    good = save({"w": torch.ones(2, 2)})
    await commit.commit(store, CommitRequest(
        run_id=RUN, token=1, step=10, worker="w",
        files=[await put(store, 1, 10, "model.safetensors", good)],
    ))  # fmt: skip
    # A bad header with a matching sha256, a name that escapes, another run's file, and a
    # manifest of another run.
    await forge(store, 20, [await put(store, 1, 20, "model.safetensors", good[:8] + b"x")])
    escaping = commit.data_key(RUN, 1, 30, "../x")
    await store.put_once(commit.data_key(RUN, 1, 30, "x"), good)
    await forge(store, 30, [ref("../x", escaping, good)])
    await store.put_once(commit.data_key("other", 1, 40, "model.safetensors"), good)
    theirs = commit.data_key("other", 1, 40, "model.safetensors")
    await forge(store, 40, [ref("model.safetensors", theirs, good)])
    await forge(store, 50, [await put(store, 1, 50, "model.safetensors", good)], "other")
    manifest, damaged = await commit.restorable(store, RUN)
    assert manifest is not None and manifest.step == 10, manifest
    assert damaged == [50, 40, 30, 20], damaged
    # A manifest too broken to read where the chain goes on is an error, not a fresh start.
    latest = await commit.read_latest(store, RUN)
    assert latest is not None, "no latest"
    key = commit.manifest_key(RUN, 60, 1)
    await store.put_once(key, b'{"step": "sixty"}')
    pointer = Pointer(run_id=RUN, token=1, step=60, manifest=key)
    await store.write_pointer(commit.latest_key(RUN), encode(pointer), latest[1])
    with pytest.raises(IntegrityError, match="unreadable, no way back past it"):
        await commit.restorable(store, RUN)


async def test_a_forged_chain_that_loops_is_refused_not_walked_forever(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    bad = await put(store, 1, 10, "model.safetensors", b"not safetensors")
    key = commit.manifest_key(RUN, 10, 1)
    looping = Manifest(
        run_id=RUN, token=1, step=10, worker="w", files=[bad], final=False, metrics={},
        digest="", previous=key, created_at=0.0,
    )  # fmt: skip
    await store.put_once(key, encode(looping))
    pointer = Pointer(run_id=RUN, token=1, step=10, manifest=key)
    await store.write_pointer(commit.latest_key(RUN), encode(pointer), None)
    with pytest.raises(IntegrityError, match="its own ancestor"):
        await commit.restorable(store, RUN)


async def test_a_download_never_writes_outside_its_directory(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    data = b"payload"
    await store.put_once(f"runs/{RUN}/x", data)
    into = tmp_path / "restore" / "into"
    into.mkdir(parents=True)
    for name in ("../x", "/tmp/x", "a/../../x", "meta.json\x00"):
        with pytest.raises(IntegrityError, match="checkpoint file name"):
            await download(store.url, [ref(name, f"runs/{RUN}/x", data)], into)
    twice = [ref("meta.json", f"runs/{RUN}/x", data)] * 2
    with pytest.raises(IntegrityError, match="cannot be downloaded"):
        await download(store.url, twice, into)
    written = sorted(p.relative_to(tmp_path) for p in (tmp_path / "restore").rglob("*"))
    assert written == [Path("restore/into"), Path("restore/into/meta.json")], written


# -- resume: tensors against meta.json and against the live objects ----------------------


class Checkpoints:
    """Checkpoints written by a real RunContext, committed by the real protocol."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store_url = f"file://{root / 'store'}"
        self.store = FileStore(root / "store")
        self.step = 0

    def context(self) -> tuple[RunContext, list[FromChild]]:
        sent: list[FromChild] = []
        task = Task(run_id=RUN, spec=SPEC)
        return RunContext(task, 1, self.store_url, self.root / "spool", sent.append), sent

    def save(self, **state: Any) -> list[FileRef]:
        ctx, sent = self.context()
        try:
            ctx.restore(**state)
            ctx.checkpoint()
        finally:
            ctx.close()
        (ready,) = [m for m in sent if isinstance(m, CheckpointReady)]
        self._commit(ready.files)
        return ready.files

    def tampered(self, files: list[FileRef], change: dict[str, bytes]) -> None:
        """Commit the checkpoint `files` again as the next step, with files replaced."""
        self.step += 1
        refs = []
        for f in files:
            data = change.get(f.name) or asyncio.run(self.store.get(f.key))
            key = commit.data_key(RUN, 1, self.step, f.name)
            asyncio.run(self.store.put_once(key, data))
            refs.append(ref(f.name, key, data))
        self._commit(refs)

    def meta(self, files: list[FileRef]) -> dict[str, Any]:
        meta_ref = next(f for f in files if f.name == "meta.json")
        loaded: dict[str, Any] = json.loads(asyncio.run(self.store.get(meta_ref.key)))
        return loaded

    def restore(self, **state: Any) -> int:
        ctx, _ = self.context()
        try:
            return ctx.restore(**state)
        finally:
            ctx.close()

    def _commit(self, files: list[FileRef]) -> None:
        req = CommitRequest(run_id=RUN, token=1, step=self.step, worker="w", files=files)
        asyncio.run(commit.commit(self.store, req))


def model(out_features: int = 4, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return torch.nn.Linear(4, out_features).to(dtype)


def unchanged(m: torch.nn.Module) -> Callable[[], bool]:
    before = {k: v.clone() for k, v in m.state_dict().items()}
    return lambda: all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_a_well_formed_checkpoint_restores_and_records_dtypes_and_shapes(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    saved = model()
    files = ckpts.save(model=saved)
    tree = ckpts.meta(files)["state"]["model"]
    weight = next(v for k, v in tree["__dict__"] if k == "weight")
    assert weight == {"__tensor__": "model.weight", "dtype": "F32", "shape": [4, 4]}, weight
    fresh = model()
    assert ckpts.restore(model=fresh) == 0, "restored to another step"
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in fresh.state_dict().items())


def test_a_checkpoint_written_before_dtypes_were_recorded_still_restores(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    saved = model()
    files = ckpts.save(model=saved)
    meta = ckpts.meta(files)
    for _key, node in meta["state"]["model"]["__dict__"]:
        del node["dtype"], node["shape"]
    ckpts.tampered(files, {"meta.json": json.dumps(meta).encode()})
    fresh = model()
    ckpts.restore(model=fresh)
    assert torch.equal(fresh.weight, saved.weight), "old-style checkpoint did not restore"


def test_a_shape_or_dtype_the_live_model_does_not_have_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    ckpts = Checkpoints(tmp_path)
    ckpts.save(model=model())
    wider = model(out_features=5)
    same = unchanged(wider)
    refused(
        lambda: ckpts.restore(model=wider),
        "model.safetensors",
        "'model.weight' is F32[4, 4] in the file",
        "the model being restored expects F32[5, 4]",
    )
    assert same(), "the model was changed by a refused restore"
    double = model(dtype=torch.float64)
    refused(lambda: ckpts.restore(model=double), "'model.bias' is F32[4]", "expects F64[4]")


def test_a_file_that_differs_from_meta_json_is_refused(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    files = ckpts.save(model=model())
    # meta.json records [4, 4]; the file holds [4, 5] — and so does the model.
    other = model(out_features=5).state_dict()
    swapped = save({f"model.{k}": v for k, v in other.items()})
    ckpts.tampered(files, {"model.safetensors": swapped})
    wider = model(out_features=5)
    same = unchanged(wider)
    refused(
        lambda: ckpts.restore(model=wider),
        "model.safetensors",
        "'model.weight' is F32[5, 4] in the file, meta.json expects F32[4, 4]",
    )
    assert same(), "the model was changed by a refused restore"
    # A tensor meta.json does not name, and one it names that the file lacks.
    extra = save({"model.weight": other["weight"][:4], "model.bias": other["bias"][:4],
                  "model.smuggled": torch.zeros(1)})  # fmt: skip
    ckpts.tampered(files, {"model.safetensors": extra})
    refused(lambda: ckpts.restore(model=model()), "'model.smuggled' is not named in meta.json")
    ckpts.tampered(files, {"model.safetensors": save({"model.weight": torch.zeros(4, 4)})})
    refused(lambda: ckpts.restore(model=model()), "meta.json names tensor 'model.bias'")


def test_malformed_meta_json_and_rng_are_refused(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    files = ckpts.save(model=model())
    meta = ckpts.meta(files)
    cases: list[tuple[bytes, str]] = [
        (b"{not json", "meta.json: not valid JSON"),
        (b"[]", "meta.json: not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "meta.json: not valid JSON"),
        (json.dumps({**meta, "rng": {}}).encode(), "malformed RNG state"),
        (json.dumps({**meta, "step": "0"}).encode(), "lacks state, cursor or step"),
    ]
    for data, needle in cases:
        ckpts.tampered(files, {"meta.json": data})
        refused(lambda: ckpts.restore(model=model()), needle)
    no_torch_rng = save({"numpy": torch.zeros(624, dtype=torch.int64)})
    ckpts.tampered(files, {"rng.safetensors": no_torch_rng})
    refused(lambda: ckpts.restore(model=model()), "rng.safetensors: has no tensor 'torch'")
    short_rng = save({"torch": torch.zeros(10, dtype=torch.uint8), "numpy": torch.zeros(624)})
    ckpts.tampered(files, {"rng.safetensors": short_rng})
    refused(lambda: ckpts.restore(model=model()), "'torch' is U8[10]", "this process's RNG")


# -- any bytes at all ---------------------------------------------------------------------


OFF_BY = st.sampled_from([0] * 6 + [1, -1])


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    """Mostly well-formed files with one or two things off, to reach every check."""
    entries: dict[str, Any] = {}
    at = 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from([*ITEMSIZE, "F128", "", "f32"]))
        shape = draw(st.lists(st.integers(0, 3) | st.sampled_from([-1, 2.0, 2**64]), max_size=3))
        dims = (d if isinstance(d, int) and 0 <= d <= 3 else 1 for d in shape)
        size = math.prod(dims) * ITEMSIZE.get(dtype, 1)
        begin = at + draw(OFF_BY)
        at = begin + max(size, 0) + draw(OFF_BY)
        entry = {"dtype": dtype, "shape": shape, "data_offsets": [begin, at]}
        if draw(st.integers(0, 9)) == 0:
            entry.pop(draw(st.sampled_from(sorted(entry))))
        entries[f"t{i}"] = entry
    if draw(st.integers(0, 3)) == 0:
        entries["__metadata__"] = draw(st.sampled_from([{"a": "b"}, {}, {"a": 1}, None]))
    header = json.dumps(entries).encode() + b" " * draw(st.integers(0, 7))
    length = len(header) + draw(st.sampled_from([0, 0, 0, 1, -1, 2**40]))
    data = draw(st.binary(min_size=max(at, 0), max_size=max(at, 0) + 2))
    whole = max(length, 0).to_bytes(8, "little") + header + data
    return whole[: draw(st.integers(0, len(whole)))] if draw(st.integers(0, 9)) == 0 else whole


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(save({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, 2)}))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[i] = draw(st.integers(0, 255))
        else:
            del data[i]
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | near_valid() | mutated())
def test_any_bytes_are_refused_cleanly_or_load(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), data)
        try:
            found = checkpoint_files.read_header(path)
        except IntegrityError as exc:
            assert str(exc).startswith("model.safetensors: "), f"unnamed file: {exc}"
            found = None
        try:
            loaded = checkpoint_files.load_tensors(path, "model.safetensors")
        except IntegrityError:
            assert found is None, "a header that passed failed to load"
            return
        assert found is not None, "loaded a file whose header was refused"
        # What passes here, safetensors itself loads, as the header says.
        direct = load_file(str(path))
        assert set(direct) == set(found) == set(loaded), (set(direct), set(found))
        for name, spec in found.items():
            assert DTYPES[spec.dtype] == direct[name].dtype, (name, spec, direct[name].dtype)
            assert spec.shape == tuple(direct[name].shape), (name, spec, direct[name].shape)
