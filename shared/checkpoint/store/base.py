"""The object-store contract every backend honours (`factory` opens them).

Only two kinds of write exist, because the commit protocol needs nothing else:

* write-once objects (`put_once`, `put_file`): a second write to the same key is refused by
  the store itself (`AlreadyExists`) — O_EXCL/link on a filesystem, `If-None-Match: *` on S3;
* the versioned pointer (`read_pointer`, `write_pointer`): a compare-and-swap on an opaque
  version — a link to the next sequence number on a filesystem, `If-Match: <etag>` on S3.

`copy` is a write-once write of another object's bytes, made inside the store where it can be
(a hard link; S3's `CopyObject` with `If-None-Match: *`): a fork's first checkpoint is its
parent's files copied into its own prefix (`shared.checkpoint.rebase`).
"""

from __future__ import annotations

import abc
import builtins
import hashlib
import tempfile
from pathlib import Path
from typing import Self

import msgspec

from shared.errors import ContractError

CHUNK = 1024 * 1024


class ObjectInfo(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    size: int
    modified: float
    """When the store accepted the object, unix seconds by the *store's* clock (the S3
    server's, the file server's): compare it only with generous margins."""


class Store(abc.ABC):
    url: str

    @abc.abstractmethod
    async def put_once(self, key: str, data: bytes) -> None:
        """Write `data` under `key` unless the key exists (`AlreadyExists`)."""

    @abc.abstractmethod
    async def put_file(self, key: str, path: Path) -> None:
        """Write a local file under `key`, write-once. The file may be consumed (moved)."""

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Read a whole object (`NotFound`). For small objects: manifests, pointers."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive) of an object (`NotFound`; `IntegrityError` if
        the object is shorter): what a rank reads of another's shard file
        (`baton.runtime.shards`). Each call is logged at DEBUG on `baton.store` with its key
        and range, the store's request log as the client sees it."""

    @abc.abstractmethod
    async def download(self, key: str, dest: Path) -> None:
        """Stream an object into a local file."""

    @abc.abstractmethod
    async def stat(self, key: str) -> tuple[int, str]:
        """Size and sha256 of an object, computed by reading it back (`NotFound`)."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix`, sorted."""

    @abc.abstractmethod
    async def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Like `list`, with each object's size and last-modified time; sorted by key."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove a key; absent keys are not an error."""

    @abc.abstractmethod
    async def read_pointer(self, key: str) -> tuple[bytes, str] | None:
        """The pointer's content and opaque version, or None if never written."""

    @abc.abstractmethod
    async def write_pointer(self, key: str, data: bytes, expected: str | None) -> str:
        """Replace the pointer if its version is still `expected` (None: never written).
        Returns the new version; raises `PreconditionFailed` when another writer won."""

    async def copy(self, src: str, dst: str) -> None:
        """Copy the object `src` to `dst`, write-once: `AlreadyExists` if `dst` exists,
        `NotFound` if `src` does not. Backends copy inside the store (a link, a server-side
        copy); this fallback goes through a local file."""
        with tempfile.TemporaryDirectory(prefix="baton-copy-") as tmp:
            local = Path(tmp) / "object"
            await self.download(src, local)
            await self.put_file(dst, local)

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, and never climb out of the store."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ContractError(f"invalid object key {key!r}")
    return key


def sha256_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
