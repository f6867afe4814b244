"""A local directory with the same semantics as the S3 backend.

Write-once is enforced by the kernel: every object is written to a private temporary file,
fsynced, then published with `link()`, which fails if the name exists — so a reader never
sees a partial object and a second writer never replaces the first. The pointer is a log of
numbered entries `<key>.d/000000000007`; writing version n+1 is a `link()` to that name, so
two writers that both read version n race for one name and exactly one wins. Directories
are fsynced after each publish so a crash cannot lose a name that was reported written.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from shared.checkpoint.store.base import CHUNK, ObjectInfo, Store, check_key, sha256_file
from shared.errors import (
    AlreadyExists,
    ContractError,
    IntegrityError,
    NotFound,
    PreconditionFailed,
)

log = logging.getLogger("baton.store")

_WIDTH = 12


class FileStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.url = f"file://{self.root}"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def put_once(self, key: str, data: bytes) -> None:
        await asyncio.to_thread(self._put_bytes, self.path(key), data)

    async def put_file(self, key: str, path: Path) -> None:
        await asyncio.to_thread(self._put_file, self.path(key), path)

    async def get(self, key: str) -> bytes:
        try:
            return await asyncio.to_thread(self.path(key).read_bytes)
        except FileNotFoundError:
            raise NotFound(key) from None

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        if not 0 <= start < end:
            raise ContractError(f"byte range {start}-{end} of {key} is empty or negative")
        log.debug("get %s bytes %d-%d", key, start, end)
        try:
            data = await asyncio.to_thread(_read_range, self.path(key), start, end)
        except FileNotFoundError:
            raise NotFound(key) from None
        if len(data) != end - start:
            raise IntegrityError(f"{key}: bytes {start}-{end} asked, {len(data)} returned")
        return data

    async def download(self, key: str, dest: Path) -> None:
        try:
            await asyncio.to_thread(shutil.copyfile, self.path(key), dest)
        except FileNotFoundError:
            raise NotFound(key) from None

    async def stat(self, key: str) -> tuple[int, str]:
        try:
            return await asyncio.to_thread(sha256_file, self.path(key))
        except FileNotFoundError:
            raise NotFound(key) from None

    async def list(self, prefix: str) -> list[str]:
        return await asyncio.to_thread(self._list, prefix)

    async def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        return await asyncio.to_thread(self._list_info, prefix)

    async def copy(self, src: str, dst: str) -> None:
        await asyncio.to_thread(self._copy, self.path(src), self.path(dst))

    async def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.unlink, self.path(key))

    async def read_pointer(self, key: str) -> tuple[bytes, str] | None:
        return await asyncio.to_thread(self._read_pointer, self.path(check_key(key) + ".d"))

    async def write_pointer(self, key: str, data: bytes, expected: str | None) -> str:
        log_dir = self.path(check_key(key) + ".d")
        return await asyncio.to_thread(self._write_pointer, log_dir, data, expected)

    # -- blocking halves, run in a thread ------------------------------------------------

    def _put_bytes(self, final: Path, data: bytes) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
        with tmp.open("xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._publish(tmp, final)

    def _put_file(self, final: Path, src: Path) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            # Same filesystem: a hard link moves the bytes without copying them.
            os.link(src, tmp)
        except OSError:
            with src.open("rb") as s, tmp.open("xb") as d:
                while chunk := s.read(CHUNK):
                    d.write(chunk)
        # A hard link keeps the source's mtime, which may be long before the upload; the
        # object's last-modified must be when the store took it, as on S3, or garbage
        # collection would judge a fresh upload by how long it sat on the trainer's disk.
        os.utime(tmp)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        self._publish(tmp, final)
        with contextlib.suppress(FileNotFoundError):
            src.unlink()

    def _copy(self, src: Path, final: Path) -> None:
        """A hard link: objects are immutable, so the copy shares the source's bytes and
        outlives its deletion (its last-modified time is the source's, which nothing but a
        listing shows). A filesystem without hard links gets a copy of the bytes."""
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            os.link(src, tmp)
        except FileNotFoundError:
            raise NotFound(str(src.relative_to(self.root))) from None
        except OSError:
            try:
                with src.open("rb") as s, tmp.open("xb") as d:
                    shutil.copyfileobj(s, d, CHUNK)
                    d.flush()
                    os.fsync(d.fileno())
            except FileNotFoundError:
                tmp.unlink(missing_ok=True)
                raise NotFound(str(src.relative_to(self.root))) from None
        self._publish(tmp, final)

    def _publish(self, tmp: Path, final: Path) -> None:
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise AlreadyExists(str(final.relative_to(self.root))) from None
        finally:
            tmp.unlink()
        _fsync_dir(final.parent)

    def _list(self, prefix: str) -> builtins.list[str]:
        return sorted(key for key, _path in self._walk(prefix))

    def _list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        found = []
        for key, path in self._walk(prefix):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted since the walk saw it: as absent as if never listed
            found.append(ObjectInfo(key=key, size=st.st_size, modified=st.st_mtime))
        return sorted(found, key=lambda info: info.key)

    def _walk(self, prefix: str) -> Iterator[tuple[str, Path]]:
        # A plain string prefix, as on S3: "runs/a" matches "runs/ab/x" too, so the walk
        # starts at the directory that holds the prefix's last partial component.
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not start.is_dir():
            return
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                path = Path(dirpath, name)
                key = str(path.relative_to(self.root))
                if key.startswith(prefix):
                    yield key, path

    def _read_pointer(self, log_dir: Path) -> tuple[bytes, str] | None:
        try:
            entries = [n for n in os.listdir(log_dir) if n.isdigit()]
        except FileNotFoundError:
            return None
        if not entries:
            return None
        newest = max(entries)
        return (log_dir / newest).read_bytes(), str(int(newest))

    def _write_pointer(self, log_dir: Path, data: bytes, expected: str | None) -> str:
        version = 1 if expected is None else int(expected) + 1
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._put_bytes(log_dir / f"{version:0{_WIDTH}d}", data)
        except AlreadyExists:
            raise PreconditionFailed(f"{log_dir.name}: version {expected} is stale") from None
        return str(version)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_range(path: Path, start: int, end: int) -> bytes:
    with path.open("rb") as f:
        f.seek(start)
        return f.read(end - start)
