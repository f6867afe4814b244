"""Validating checkpoint files: their names, where they live, and what is inside them.

A checkpoint is a set of plain files: `<group>.safetensors` (one per registered object, plus
`rng`) and `meta.json`, stored under its own immutable prefix
`runs/<run>/data/<token>/<step>/`. In a run of several ranks, rank k >= 1 adds its own shard
under the same prefix, each name prefixed `rank<k>.` (`rank1.meta.json`,
`rank1.rng.safetensors`, `rank1.data.safetensors`); rank 0's names are unprefixed.
Everything about them comes from storage or from a message, so nothing is trusted before it
is checked here:

A checkpoint written by a framework that owns the training loop (`baton.runtime.external`)
holds, besides `meta.json` and `rng.safetensors`, the framework's own files as it wrote
them, each named `file.<its name>` (`file.optimizer.pt`, `rank1.file.random_states_1.pkl`):
opaque bytes to Baton, checked by size and sha256 like every file, handed back to the
framework as they were.

* a name is a plain file name from that set, never a path (it becomes a local path when a
  checkpoint is downloaded), and a key is exactly the checkpoint's prefix plus the name;
* a safetensors header is parsed here, strictly and within a size cap, before the file is
  handed to safetensors, so a hostile length cannot make the loader allocate or read at will
  and a bad file is refused with a message that says what is wrong;
* what a file holds is compared, tensor by tensor, with what `meta.json` recorded at save
  time and with the live object it is about to be loaded into, so a mismatch is reported
  with the tensor named instead of surfacing as torch's error from `load_state_dict`.

Every refusal is an `IntegrityError` (malformed stored bytes); `shared.checkpoint.commit`
turns those about a commit *request* into `ContractError`s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from shared.contracts import FileRef
from shared.errors import IntegrityError

if TYPE_CHECKING:
    import torch

# The checkpointer and the CLI check files without ever loading a tensor: torch (seconds to
# import) is imported only by `load_tensors`, and dtypes are known here by name and size.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
"""Bytes per element of every dtype a checkpoint may hold, by its safetensors name: those
safetensors both writes and reads back into torch (`shared.checkpoint.tensors.DTYPES`)."""


class TensorSpec(NamedTuple):
    dtype: str
    """A key of `ITEMSIZE`."""
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


META = "meta.json"
SUFFIX = ".safetensors"
MAX_NAME = 128
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Far above any real header (a few hundred bytes per tensor), far below memory trouble."""
_MAX_ELEMENTS = 2**62
"""safetensors multiplies dimensions in 64 bits; a product past this is refused first."""
_GROUP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_RANKED = re.compile(r"rank([1-9][0-9]{0,2})\.(.+)")
"""A rank's shard: `rank<k>.` (k >= 1, no leading zero) before a plain file name. A group name
has no dot, so a name is either plain or ranked, never both."""
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}
FILE_PREFIX = "file."
"""Before each name of a framework's own file (`baton.runtime.external`)."""
_FOREIGN = re.compile(r"file\.([A-Za-z0-9_][A-Za-z0-9_.-]*)")


def check_name(name: str) -> str:
    """`name` if it is a checkpoint file name (`<group>.safetensors`, `meta.json`)."""
    if not name:
        problem = "is empty"
    elif any(ord(c) < 0x20 or c == "\x7f" for c in name):
        problem = "contains a control character"
    elif name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        problem = "is an absolute path"
    elif "/" in name or "\\" in name:
        problem = "is a path, not a plain file name"
    elif name.startswith("."):
        problem = "starts with a dot"
    elif len(name) > MAX_NAME:
        problem = f"is longer than {MAX_NAME} characters"
    elif not _plain(name) and not ((m := _RANKED.fullmatch(name)) and _plain(m.group(2))):
        problem = (
            f"is neither {META}, <group>{SUFFIX} nor {FILE_PREFIX}<name>, nor one of them"
            " after rank<k>."
        )
    else:
        return name
    raise IntegrityError(f"checkpoint file name {name!r} {problem}")


def _plain(name: str) -> bool:
    return (
        name == META
        or (name.endswith(SUFFIX) and bool(_GROUP.fullmatch(name[: -len(SUFFIX)])))
        or bool(_FOREIGN.fullmatch(name))
    )


def foreign_name(name: str) -> str | None:
    """The framework's own name of a (checked) file of its (`file.<name>`, any rank's);
    None for a file of Baton's."""
    m = _RANKED.fullmatch(name)
    f = _FOREIGN.fullmatch(m.group(2) if m else name)
    return f.group(1) if f else None


def rank_prefix(rank: int) -> str:
    """What rank `rank`'s own files are named with: nothing for rank 0."""
    return f"rank{rank}." if rank else ""


def rank_of(name: str) -> int:
    """The rank whose shard a (checked) file name belongs to: 0 for a plain name."""
    m = None if _plain(name) else _RANKED.fullmatch(name)
    return int(m.group(1)) if m else 0


def check_shards(names: Collection[str], ranks: int, sharded: Collection[str] = ()) -> None:
    """Every rank of a group of `ranks` has its shard among `names` (its meta.json and RNG
    state at least, and its part of every `sharded` group: `shared.checkpoint.shards`), and
    no file belongs to a rank outside the group."""
    strays = sorted(n for n in names if rank_of(n) >= ranks)
    if strays:
        raise IntegrityError(f"{strays[0]} belongs to no rank of a group of {ranks}")
    for group in sharded:
        if not _GROUP.fullmatch(group):
            raise IntegrityError(f"sharded group {group!r} is not a group name")
    bases = [f"{g}{SUFFIX}" for g in sharded]
    if ranks > 1:  # a single process wrote all of its own at once; nothing else can be missing
        bases += [META, f"rng{SUFFIX}"]
    for rank in range(ranks):
        for base in bases:
            if (name := rank_prefix(rank) + base) not in names:
                raise IntegrityError(f"rank {rank}'s shard is incomplete: no {name}")


def group_of(name: str) -> str | None:
    """The registered name a (checked) file of Baton's tensors holds, any rank's."""
    m = None if _plain(name) else _RANKED.fullmatch(name)
    base = m.group(2) if m else name
    return base[: -len(SUFFIX)] if is_tensor_file(base) else None


def is_tensor_file(name: str) -> bool:
    """A safetensors file of Baton's, whose header is checked; a framework's own files are
    opaque (`file.model.safetensors` included)."""
    return name.endswith(SUFFIX) and foreign_name(name) is None


def check_refs(files: Sequence[FileRef], prefix: str) -> None:
    """Every file has a checkpoint file name, once, and lives at `prefix` + its name: the
    checkpoint's own immutable prefix, never another run's or checkpoint's objects."""
    if not files:
        raise IntegrityError("a checkpoint needs at least one file")
    seen = set()
    for ref in files:
        check_name(ref.name)
        if ref.key != prefix + ref.name:
            raise IntegrityError(
                f"{ref.name}: key {ref.key!r} is not under this checkpoint's prefix {prefix!r}"
            )
        if ref.name in seen:
            raise IntegrityError(f"{ref.name}: listed twice")
        seen.add(ref.name)


class Header(NamedTuple):
    """A checked safetensors header."""

    tensors: dict[str, TensorSpec]
    spans: dict[str, tuple[int, int]]
    """Where each tensor's bytes are in the file: [begin, end) from the file's first byte."""
    metadata: dict[str, str]
    """Its `__metadata__` (a sharded file's chunk offsets: `shared.checkpoint.shards`)."""


def read_header(path: Path, label: str | None = None) -> dict[str, TensorSpec]:
    """The tensors a safetensors file holds, after checking that its header is one that
    safetensors will load without surprise: at most as lenient as safetensors itself."""
    return header_of(path, label).tensors


def header_of(path: Path, label: str | None = None) -> Header:
    """A local safetensors file's header, checked as `read_header` does."""
    label = label or path.name
    with path.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        length = header_length(f.read(8), size, label)
        raw = f.read(length)
    return parse_header(raw, size, label)


def header_length(first: bytes, size: int, label: str) -> int:
    """The header's length, from a safetensors file's first 8 bytes and its size."""
    if size < 8 or len(first) < 8:
        raise IntegrityError(f"{label}: {size} bytes, too short for a safetensors header")
    length = int.from_bytes(first[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise IntegrityError(
            f"{label}: header length {length} is over the limit of {MAX_HEADER_BYTES}"
        )
    if 8 + length > size:
        raise IntegrityError(
            f"{label}: header length {length} runs past the end of the {size}-byte file"
        )
    return length


def parse_header(raw: bytes, size: int, label: str) -> Header:
    """The header `raw` (the bytes after the length) of a safetensors file of `size` bytes."""
    data_size = size - 8 - len(raw)
    try:
        if not raw.startswith(b"{"):
            raise ValueError("it does not start with '{'")
        header = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
        )
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise IntegrityError(f"{label}: header is not a JSON object: {exc}") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{label}: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError(f"{label}: __metadata__ is not a map of strings")
    specs: dict[str, TensorSpec] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        spec, begin, end = _entry(name, entry, label)
        specs[name] = spec
        spans.append((begin, end, name))
    # safetensors wants the data to be exactly the tensors, back to back, nothing between.
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise IntegrityError(
                f"{label}: tensor {name!r} starts at byte {begin} of the data, expected {at}"
            )
        at = end
    if at != data_size:
        raise IntegrityError(f"{label}: tensors cover {at} bytes of data, the file has {data_size}")
    start = 8 + len(raw)
    return Header(specs, {n: (start + b, start + e) for b, e, n in spans}, metadata)


def _entry(name: str, entry: Any, label: str) -> tuple[TensorSpec, int, int]:
    def bad(problem: str) -> IntegrityError:
        return IntegrityError(f"{label}: tensor {name!r} {problem}")

    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise bad(f"needs exactly {sorted(_ENTRY_FIELDS)}, has {_fields(entry)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise bad(f"has a shape that is not a list of non-negative integers: {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))):
        raise bad(f"has data_offsets that are not two non-negative integers: {offsets!r}")
    begin, end = offsets
    count = 1
    for d in shape:
        count *= d
        if count > _MAX_ELEMENTS:
            raise bad(f"has too many elements: shape {shape}")
    nbytes = count * ITEMSIZE[dtype]
    if end - begin != nbytes:
        raise bad(
            f"is {dtype}{shape} ({nbytes} bytes) but data_offsets {offsets} span {end - begin}"
        )
    return TensorSpec(dtype, tuple(shape)), begin, end


def compare(
    label: str,
    found: Mapping[str, TensorSpec],
    expected: Mapping[str, TensorSpec | None],
    expected_by: str,
    *,
    exact: bool,
) -> None:
    """Refuse tensors whose dtype or shape in the file differs from what `expected_by`
    expects (None: nothing recorded). `exact`: the two must also name the same tensors."""
    problems = []
    for name, spec in found.items():
        if name not in expected:
            if exact:
                problems.append(f"tensor {name!r} is not named in {expected_by}")
        elif (want := expected[name]) is not None and want != spec:
            problems.append(f"tensor {name!r} is {spec} in the file, {expected_by} expects {want}")
    if exact:
        problems += [
            f"{expected_by} names tensor {n!r}, not in the file" for n in expected if n not in found
        ]
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise IntegrityError(f"{label}: " + "; ".join(problems[:5]) + more)


def check_tensors(
    path: Path,
    label: str,
    *,
    recorded: Mapping[str, TensorSpec | None] | None = None,
    live: Mapping[str, TensorSpec] | None = None,
    live_name: str = "the object being restored",
    required: Collection[str] = (),
) -> dict[str, TensorSpec]:
    """A safetensors file's tensors, after checking its header and then its tensors against
    what meta.json `recorded` (exactly the same names) and the `live` object they are to be
    loaded into (the tensors both have). Reads the header only: cheap enough to check every
    file of a checkpoint before loading any."""
    found = read_header(path, label)
    if recorded is not None:
        compare(label, found, recorded, META, exact=True)
    missing = [n for n in required if n not in found]
    if missing:
        raise IntegrityError(f"{label}: has no tensor {missing[0]!r}")
    if live is not None:
        compare(label, found, live, live_name, exact=False)
    return found


def load_tensors(path: Path, label: str) -> dict[str, torch.Tensor]:
    """Load a safetensors file whose header is checked first (again: it costs nothing
    next to the load, and the load is then never the first to see the header)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    read_header(path, label)
    try:
        return load_file(str(path))
    except SafetensorError as exc:  # a header this module accepts should never get here
        raise IntegrityError(f"{label}: {exc}") from None


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json as a JSON object; anything else is refused."""
    try:
        meta = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{META}: not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise IntegrityError(f"{META}: not a JSON object")
    return meta


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _fields(entry: Any) -> str:
    return repr(sorted(map(str, entry))) if isinstance(entry, dict) else type(entry).__name__


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key appears twice")
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")
