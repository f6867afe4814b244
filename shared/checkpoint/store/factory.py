"""The one factory that opens a store: above the backends, which know nothing of it. Each
backend is imported only when a URL asks for it (S3's client is slow to import)."""

from __future__ import annotations

from pathlib import Path

from shared.checkpoint.store.base import Store
from shared.errors import ConfigError


def open_store(url: str) -> Store:
    """`file:///abs/dir` (or `file://./rel`) or `s3://bucket[/prefix]`."""
    if url.startswith("file://"):
        from shared.checkpoint.store.file import FileStore

        return FileStore(Path(url.removeprefix("file://")))
    if url.startswith("s3://"):
        from shared.checkpoint.store.s3 import S3Store

        return S3Store.from_url(url)
    raise ConfigError(f"unsupported store URL {url!r}: use file:///dir or s3://bucket/prefix")
