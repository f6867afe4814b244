"""A W&B run's local files, read back: what the run already holds where no server can say.

Every process that logs to a W&B run leaves a folder under `<WANDB_DIR>/wandb/`,
`offline-run-<time>-<id>` (`WANDB_MODE=offline`) or `run-<time>-<id>` (online), holding
`run-<id>.wandb`: W&B's transaction log of the run, the file `wandb sync` uploads. Its
format is LevelDB's log format behind a 7-byte header (`:W&B`, 0xBEE1 little-endian, a
version byte): 32 KiB blocks of records, each with a CRC-32 (of its type byte, then its
data), a length and a type — whole, or the first, a middle or the last part of one split
across blocks; a block's last bytes, too few for a record's header, are padding. Each
record's data is a `wandb_internal_pb2.Record` protobuf (W&B's own message classes parse
it). W&B's Python reader of these files left the package with its Go core; `wandb sync`
reads the format back across versions, so it stays put.

A file whose process was killed ends mid-record, or with a record W&B never finished
writing: reading stops there, as `wandb sync` does.
"""

from __future__ import annotations

import importlib
import json
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")
IDENT, MAGIC = b":W&B", 0xBEE1
RECORD = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The data of each whole record of a `.wandb` file, in order, up to its first torn or
    damaged one."""
    return (data for _, data in _records(path, HEADER.size))


class Tail:
    """The newest step of the rows in a run's file that its process is still writing, each
    read going on from the last whole record the previous one found."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.newest = -1
        self._at = HEADER.size

    def read(self) -> int:
        if self.path.exists():
            for end, data in _records(self.path, self._at):
                self._at = end
                record = _parse(data)
                if record.WhichOneof("record_type") == "history":
                    self.newest = max(self.newest, int(record.history.step.num))
        return self.newest


def _records(path: Path, start: int) -> Iterator[tuple[int, bytes]]:
    """(the position after it, its data) of each whole record of a `.wandb` file from
    `start` on (the header's end, or a position this gave), up to its first torn or
    damaged one."""
    with path.open("rb") as f:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            return
        ident, magic, _version = HEADER.unpack(head)
        if ident != IDENT or magic != MAGIC:
            raise ValueError(f"{path}: not a W&B run file")
        f.seek(start)
        data = f.read()
    parts = b""
    for end, kind, body in _fragments(data, start):
        if kind == FULL:
            yield end, body
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            yield end, parts + body
            parts = b""


def _fragments(data: bytes, base: int) -> Iterator[tuple[int, int, bytes]]:
    """Each fragment's (position after it, type, data) in `data`, the file's bytes from
    position `base` on, up to the first torn or damaged one."""
    i = 0
    while i + RECORD.size <= len(data):
        left = BLOCK - (base + i) % BLOCK
        if left < RECORD.size:  # the block's padding
            i += left
            continue
        crc, length, kind = RECORD.unpack_from(data, i)
        body = data[i + RECORD.size : i + RECORD.size + length]
        if kind == 0 and length == 0:  # zeros: nothing was written here (yet)
            return
        if len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            return
        i += RECORD.size + length
        yield base + i, kind, body


def folders(root: Path, wandb_id: str) -> list[Path]:
    """The folders of W&B run `wandb_id` under `root` (a `WANDB_DIR`'s `wandb/`), oldest
    first: their names carry the second each process started in, and W&B numbers a second
    folder of the same second `-1`, `-2`, …"""
    name = re.compile(rf"(?:offline-)?run-(\d{{8}}_\d{{6}})-{re.escape(wandb_id)}(?:-(\d+))?")
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        if m := name.fullmatch(path.name):
            found.append(((m.group(1), int(m.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def history(root: Path, wandb_id: str) -> list[tuple[int, dict[str, Any]]]:
    """Every history row W&B run `wandb_id` holds in the folders under `root`: (its step,
    its values — `_step`, `_timestamp` and `_runtime` among them), in the order written."""
    return [row for folder in folders(root, wandb_id) for row in _rows(folder, wandb_id)]


def config(folder: Path, wandb_id: str) -> dict[str, Any]:
    """The run's config as `folder`'s file sets it (its `config` records, in order)."""
    found: dict[str, Any] = {}
    for record in _parsed(folder, wandb_id, "config"):
        found |= {item.key: json.loads(item.value_json) for item in record.config.update}
    return found


def _rows(folder: Path, wandb_id: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for record in _parsed(folder, wandb_id, "history"):
        values = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        yield int(record.history.step.num), values


def _parsed(folder: Path, wandb_id: str, kind: str) -> Iterator[Any]:
    """The records of `kind` in `folder`'s file of the run, parsed."""
    path = folder / f"run-{wandb_id}.wandb"
    if not path.exists():  # a process that logged nothing, or is starting
        return
    for data in records(path):
        record = _parse(data)
        if record.WhichOneof("record_type") == kind:
            yield record


def _parse(data: bytes) -> Any:
    # Generated per protobuf version and re-exported: to mypy, Any.
    pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")
    record = pb.Record()
    record.ParseFromString(data)
    return record


def newest_step(folder: Path, wandb_id: str) -> int:
    """The newest step of W&B run `wandb_id` whose row is in `folder`'s file; -1 for none."""
    return max((step for step, _ in _rows(folder, wandb_id)), default=-1)
