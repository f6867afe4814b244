"""S3-compatible object storage with the semantics of `FileStore`, enforced by the server.

Write-once is `PutObject` with `If-None-Match: *`; the pointer is one object replaced with
`If-Match: <etag>`. The store refuses the loser of either race with 412, so two writers
cannot both win whatever their leases or clocks say.

botocore's own retries are switched off: a conditional PUT retried after its first attempt
landed is refused by that very success, and would be reported as lost. Here every failure
that leaves the outcome open (timeout, dropped connection, 5xx, 409) marks the write as
ambiguous, and a refusal that follows is settled by reading the key back: exactly our bytes
there mean we won (each call retried, or its failure named, by `s3calls.py`).

Payload signing is off; every PUT carries its SHA-256 as `x-amz-checksum-sha256` instead, so
the server still rejects a damaged body (BadDigest), while the hash of a large file is taken
once in a worker thread rather than by the signer inside the event loop.

A file larger than `part_bytes` goes up in parts, each retried on its own, and a failed call
leaves its progress for the next (`multipart.py`); every file is read through the process's
upload cap, `BATON_UPLOAD_BPS` (`pace.py`).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import aioboto3
import botocore.exceptions as bex
from aiobotocore.config import AioConfig

from shared import config
from shared.backoff import Backoff
from shared.checkpoint.store.base import CHUNK, ObjectInfo, Store, check_key, sha256_file
from shared.checkpoint.store.multipart import MIN_PART_BYTES, PART_BYTES, Upload, put_multipart
from shared.checkpoint.store.pace import PacedFile, pace_for
from shared.checkpoint.store.s3calls import error, parse_url, retried
from shared.errors import (
    AlreadyExists,
    ConfigError,
    ContractError,
    IntegrityError,
    NotFound,
    PreconditionFailed,
)

log = logging.getLogger("baton.store")

T = TypeVar("T")

COPY_MAX_BYTES = 5 * 1024**3
"""The largest object S3 copies in one `CopyObject`."""


class S3Store(Store):
    list_page_size = 1000

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str = "us-east-1",
        attempts: int = 5,
        backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 30.0,
        upload_bps: float = 0.0,
        part_bytes: int = PART_BYTES,
    ) -> None:
        """`upload_bps`: this process's cap on bytes/s of checkpoint files sent (0: none);
        `part_bytes`: files larger than this go up in parts of this size (≥ 5 MiB)."""
        if part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"S3 parts must be at least {MIN_PART_BYTES} bytes")
        self.part_bytes = part_bytes
        self.pace = pace_for(upload_bps)
        self.uploads: dict[str, Upload] = {}
        """Multipart uploads under way, by key: what a retried `put_file` goes on from."""
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint = endpoint
        self.region = region
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._config = AioConfig(
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            retries={"total_max_attempts": 1},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=32,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._stack = AsyncExitStack()
        self._s3: Any = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3Store:
        """`s3://bucket[/prefix]`. Endpoint and region come from the environment, and
        credentials only from the standard AWS chain, so no secret ever sits in a URL."""
        bucket, prefix = parse_url(url)
        env = os.environ
        return cls(
            bucket,
            prefix,
            endpoint=env.get("BATON_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL") or None,
            region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            upload_bps=config.upload_bps(env),
        )

    def _key(self, key: str) -> str:
        return self._root + check_key(key)

    # -- the contract ----------------------------------------------------------------------

    async def put_once(self, key: str, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        etag, ambiguous = await self._put_if(
            key, lambda: contextlib.nullcontext(data), digest, IfNoneMatch="*"
        )
        if etag is None and not (ambiguous and await self._holds(key, len(data), digest)):
            raise AlreadyExists(key)

    async def put_file(self, key: str, path: Path) -> None:
        check_key(key)
        if (await asyncio.to_thread(path.stat)).st_size > self.part_bytes:
            await put_multipart(self, key, path)
        else:
            size, digest = await asyncio.to_thread(sha256_file, path)
            body = functools.partial(PacedFile, path, 0, size, self.pace)
            etag, ambiguous = await self._put_if(key, body, digest, IfNoneMatch="*")
            if etag is None and not (ambiguous and await self._holds(key, size, digest)):
                raise AlreadyExists(key)
        await asyncio.to_thread(path.unlink, missing_ok=True)

    async def get(self, key: str) -> bytes:
        data, _etag = await self._get(key)
        return data

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        full = self._key(key)
        if not 0 <= start < end:
            raise ContractError(f"byte range {start}-{end} of {key} is empty or negative")
        log.debug("get %s bytes %d-%d", key, start, end)

        async def op(s3: Any) -> bytes:
            resp = await s3.get_object(
                Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}"
            )
            body = resp["Body"]
            async with body:
                return bytes(await body.read())

        data = await self._retry(f"get {key} bytes {start}-{end}", key, op)
        if len(data) != end - start:  # a server answers a range past the end with less
            raise IntegrityError(f"{key}: bytes {start}-{end} asked, {len(data)} returned")
        return data

    async def download(self, key: str, dest: Path) -> None:
        full = self._key(key)

        async def op(s3: Any) -> None:
            resp = await s3.get_object(Bucket=self.bucket, Key=full)
            body = resp["Body"]
            # Each attempt rewrites the file from the start; `wb` truncates a partial one.
            f = await asyncio.to_thread(dest.open, "wb")
            try:
                async with body:
                    while chunk := await body.read(CHUNK):
                        await asyncio.to_thread(f.write, chunk)
            finally:
                await asyncio.to_thread(f.close)

        await self._retry(f"download {key}", key, op)

    async def stat(self, key: str) -> tuple[int, str]:
        full = self._key(key)

        async def op(s3: Any) -> tuple[int, str]:
            resp = await s3.get_object(Bucket=self.bucket, Key=full)
            body = resp["Body"]
            digest = hashlib.sha256()
            size = 0
            async with body:
                while chunk := await body.read(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
            return size, digest.hexdigest()

        return await self._retry(f"stat {key}", key, op)

    async def list(self, prefix: str) -> list[str]:
        # One ListObjectsV2 walk serves both: the listing carries sizes and times anyway.
        return [info.key for info in await self.list_info(prefix)]

    async def list_info(self, prefix: str) -> builtins.list[ObjectInfo]:
        if prefix:
            check_key(prefix.rstrip("/") or prefix)

        async def op(s3: Any) -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            pages = s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=self._root + prefix,
                PaginationConfig={"PageSize": self.list_page_size},
            )
            async for page in pages:
                found.extend(
                    ObjectInfo(
                        key=o["Key"][len(self._root) :],
                        size=int(o["Size"]),
                        # botocore parses LastModified into an aware datetime (UTC).
                        modified=o["LastModified"].timestamp(),
                    )
                    for o in page.get("Contents", [])
                )
            return sorted(found, key=lambda info: info.key)

        return await self._retry(f"list {prefix!r}", prefix, op)

    async def delete(self, key: str) -> None:
        full = self._key(key)

        async def op(s3: Any) -> None:
            await s3.delete_object(Bucket=self.bucket, Key=full)

        with contextlib.suppress(NotFound):
            await self._retry(f"delete {key}", key, op)

    async def copy(self, src: str, dst: str) -> None:
        """`CopyObject` with `If-None-Match: *`, inside the server. One larger than S3's
        limit for a single copy goes through a local file (as an upload, in parts)."""
        size = await self._size(src)
        if size > COPY_MAX_BYTES:
            await super().copy(src, dst)
            return
        source = {"Bucket": self.bucket, "Key": self._key(src)}
        full = self._key(dst)
        calls = 0

        async def op(s3: Any) -> bool:
            nonlocal calls
            calls += 1
            try:
                await s3.copy_object(
                    Bucket=self.bucket, Key=full, CopySource=source, IfNoneMatch="*"
                )
            except bex.ClientError as e:
                status, code = error(e)
                if status == 412 or code == "PreconditionFailed":
                    return False
                raise
            return True

        if await self._retry(f"copy {src} to {dst}", src, op):
            return
        # Refused after an attempt whose reply was lost: our own copy may be what is there.
        if calls > 1 and await self._holds(dst, *await self.stat(src)):
            return
        raise AlreadyExists(dst)

    async def read_pointer(self, key: str) -> tuple[bytes, str] | None:
        try:
            return await self._get(key)
        except NotFound:
            return None

    async def write_pointer(self, key: str, data: bytes, expected: str | None) -> str:
        digest = hashlib.sha256(data).hexdigest()
        cond = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        etag, ambiguous = await self._put_if(
            key, lambda: contextlib.nullcontext(data), digest, **cond
        )
        if etag is not None:
            return etag
        if ambiguous:
            now = await self.read_pointer(key)
            if now is not None and now[0] == data:
                log.info("pointer %s: lost reply, but our write landed", key)
                return now[1]
        raise PreconditionFailed(f"{key}: version {expected} is stale")

    async def close(self) -> None:
        stack, self._stack, self._s3 = self._stack, AsyncExitStack(), None
        await stack.aclose()

    # -- plumbing --------------------------------------------------------------------------

    async def _client(self) -> Any:
        if self._s3 is None:
            async with self._lock:
                if self._s3 is None:
                    session = aioboto3.Session(region_name=self.region)
                    self._s3 = await self._stack.enter_async_context(
                        session.client("s3", endpoint_url=self.endpoint, config=self._config)
                    )
        return self._s3

    async def _get(self, key: str) -> tuple[bytes, str]:
        full = self._key(key)

        async def op(s3: Any) -> tuple[bytes, str]:
            resp = await s3.get_object(Bucket=self.bucket, Key=full)
            body = resp["Body"]
            async with body:
                return await body.read(), str(resp["ETag"])

        return await self._retry(f"get {key}", key, op)

    async def _put_if(
        self,
        key: str,
        body: Callable[[], AbstractContextManager[Any]],
        sha256_hex: str,
        **condition: str,
    ) -> tuple[str | None, bool]:
        """PUT under a precondition: (new ETag, _) or, when refused, (None, ambiguous), where
        ambiguous means an earlier attempt failed in a way that may have written the object."""
        full = self._key(key)
        calls = 0
        checksum = base64.b64encode(bytes.fromhex(sha256_hex)).decode()

        async def op(s3: Any) -> str | None:
            nonlocal calls
            calls += 1
            with body() as payload:
                try:
                    resp = await s3.put_object(
                        Bucket=self.bucket,
                        Key=full,
                        Body=payload,
                        ChecksumSHA256=checksum,
                        **condition,
                    )
                except bex.ClientError as e:
                    # AWS answers If-Match on a missing key with 404, SeaweedFS with 412;
                    # either way the expected version is gone.
                    status, code = error(e)
                    if status == 412 or code == "PreconditionFailed":
                        return None
                    if code == "NoSuchKey" and "IfMatch" in condition:
                        return None
                    raise
            return str(resp["ETag"])

        etag = await self._retry(f"put {key}", key, op)
        return etag, calls > 1

    async def _size(self, key: str) -> int:
        full = self._key(key)

        async def op(s3: Any) -> int:
            resp = await s3.head_object(Bucket=self.bucket, Key=full)
            return int(resp["ContentLength"])

        return await self._retry(f"head {key}", key, op)

    async def _holds(self, key: str, size: int, sha256_hex: str) -> bool:
        """Whether `key` holds exactly these bytes: settles a refusal after a lost reply."""
        try:
            found = await self.stat(key)
        except NotFound:
            return False
        if found == (size, sha256_hex):
            log.info("object %s: lost reply, but our write landed", key)
            return True
        return False

    async def _retry(self, what: str, key: str, op: Callable[[Any], Awaitable[T]]) -> T:
        s3 = await self._client()
        # Full jitter: racers that collided once should not collide again in step.
        delays = Backoff(self.backoff_s, self.max_backoff_s, jitter=True)
        return await retried(s3, f"{self.url}: {what}", self.attempts, delays, what, key, op)
