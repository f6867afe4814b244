"""Files larger than one part go to S3 in parts, each retried on its own, so a link that
flaps mid-upload costs at most the part in flight, never what was already sent.

Invariant: write-once holds exactly as for a single PUT. The object appears only when
`CompleteMultipartUpload` is accepted, and that request carries `If-None-Match: *`: the
store refuses it (412) when the key exists, so of two writers only one completes. A refusal
after an attempt whose outcome was lost is settled by reading the key back, as
`S3Store._holds` does for a PUT: exactly our bytes there mean our completion landed.

Progress outlives a failed call. The store remembers, per key, the upload and the parts the
server acknowledged; the next `put_file` of the same file (same size and SHA-256) goes on
from the first missing part — the checkpoint writer retries until the store answers again
(`baton/runtime/snapshot.py`). An upload the server no longer knows (`NoSuchUpload`:
aborted or expired) is started again from the first part, once per call.

Every part carries its SHA-256, so the store rejects a damaged part (BadDigest) as it does
a damaged PUT; parts are read through the upload cap (`pace.py`). S3 refuses parts under
5 MiB but the last, hence `MIN_PART_BYTES`.

An upload abandoned by a process that died is not an object: no listing shows it and the
reaper's garbage collection cannot see it. A bucket lifecycle rule
(`AbortIncompleteMultipartUpload`) removes such uploads (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import botocore.exceptions as bex

from shared.checkpoint.store.base import CHUNK
from shared.checkpoint.store.pace import Pace, PacedFile
from shared.errors import AlreadyExists, StoreUnavailable

log = logging.getLogger("baton.store")

MIN_PART_BYTES = 5 * 1024 * 1024
PART_BYTES = 8 * 1024 * 1024
"""The default part: what the AWS CLI uses; at 2 Mbit/s, half a minute on the wire."""

_GONE = "gone"

T = TypeVar("T")


@dataclass
class Upload:
    """An upload in progress: the server's id and what it acknowledged so far."""

    upload_id: str
    size: int
    sha256: str
    parts: dict[int, str] = field(default_factory=dict)
    """Part number (from 1) → the ETag the server answered."""
    completing: bool = False
    """A completion was sent: a refusal now may be our own earlier success."""


def digests(path: Path, part_bytes: int) -> tuple[int, str, list[str]]:
    """Size, SHA-256 (hex) of the whole file and SHA-256 (base64) of each part, in one
    read."""
    whole = hashlib.sha256()
    parts: list[str] = []
    size = 0
    with path.open("rb") as f:
        while True:
            part = hashlib.sha256()
            left = part_bytes
            while left and (chunk := f.read(min(CHUNK, left))):
                whole.update(chunk)
                part.update(chunk)
                left -= len(chunk)
                size += len(chunk)
            if left == part_bytes:
                break
            parts.append(base64.b64encode(part.digest()).decode())
    return size, whole.hexdigest(), parts



class Parted(Protocol):
    """What an upload in parts needs of its store (`shared.checkpoint.store.s3.S3Store`),
    named here so that this module need not import the store that imports it."""

    bucket: str
    part_bytes: int
    pace: Pace | None
    uploads: dict[str, Upload]

    def _key(self, key: str) -> str: ...

    async def _holds(self, key: str, size: int, sha256_hex: str) -> bool: ...

    async def _retry(self, what: str, key: str, op: Callable[[Any], Awaitable[T]]) -> T: ...

async def put_multipart(store: Parted, key: str, path: Path) -> None:
    """Write `path` under `key`, write-once, in parts of `store.part_bytes`. A transient
    failure leaves the upload's progress with `store` for the next call."""
    size, sha256, sums = await asyncio.to_thread(digests, path, store.part_bytes)
    for _ in range(2):  # a second go only when the server forgot the first
        up = store.uploads.get(key)
        if up is None or (up.size, up.sha256) != (size, sha256):
            up = store.uploads[key] = await _start(store, key, size, sha256)
        sent = await _send_parts(store, key, path, up, sums)
        result = await _complete(store, key, up, sums) if sent else _GONE
        del store.uploads[key]
        if result is None:
            await _abort(store, key, up)
            raise AlreadyExists(key)
        if result != _GONE:
            return
        log.info("the store forgot the upload of %s; starting it again", key)
    raise StoreUnavailable(f"the store forgot the upload of {key} twice; try again")


async def _start(store: Parted, key: str, size: int, sha256: str) -> Upload:
    async def op(s3: Any) -> str:
        resp = await s3.create_multipart_upload(
            Bucket=store.bucket, Key=store._key(key), ChecksumAlgorithm="SHA256"
        )
        return str(resp["UploadId"])

    return Upload(await store._retry(f"start upload {key}", key, op), size, sha256)


async def _send_parts(store: Parted, key: str, path: Path, up: Upload, sums: list[str]) -> bool:
    """Send every part the server has not acknowledged; False if it forgot the upload."""
    for number, checksum in enumerate(sums, start=1):
        if number not in up.parts:
            etag = await _send_part(store, key, path, up, number, checksum, len(sums))
            if etag == _GONE:
                return False
            up.parts[number] = etag
    return True


async def _send_part(
    store: Parted, key: str, path: Path, up: Upload, number: int, checksum: str, of: int
) -> str:
    offset = (number - 1) * store.part_bytes
    length = min(store.part_bytes, up.size - offset)

    async def op(s3: Any) -> str:
        with PacedFile(path, offset, length, store.pace) as body:
            try:
                resp = await s3.upload_part(
                    Bucket=store.bucket, Key=store._key(key), UploadId=up.upload_id,
                    PartNumber=number, Body=body, ContentLength=length, ChecksumSHA256=checksum,
                )  # fmt: skip
            except bex.ClientError as e:
                if _code(e) == "NoSuchUpload":
                    return _GONE
                raise
        return str(resp["ETag"])

    return await store._retry(f"put {key} part {number}/{of}", key, op)


async def _complete(store: Parted, key: str, up: Upload, sums: list[str]) -> str | None:
    """The new object's ETag; None if the key exists (someone else's, or ours from an
    earlier completion: the caller tells which); `_GONE` if the server forgot the upload."""
    parts = [
        {"PartNumber": n, "ETag": up.parts[n], "ChecksumSHA256": sums[n - 1]}
        for n in sorted(up.parts)
    ]

    async def op(s3: Any) -> str | None:
        ambiguous, up.completing = up.completing, True
        try:
            resp = await s3.complete_multipart_upload(
                Bucket=store.bucket, Key=store._key(key), UploadId=up.upload_id,
                MultipartUpload={"Parts": parts}, IfNoneMatch="*",
            )  # fmt: skip
        except bex.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status == 412 or _code(e) in ("PreconditionFailed", "NoSuchUpload"):
                # Ours if an earlier completion of this upload got through unseen.
                if ambiguous and await store._holds(key, up.size, up.sha256):
                    return "ours"
                return _GONE if _code(e) == "NoSuchUpload" else None
            raise
        return str(resp["ETag"])

    return await store._retry(f"complete {key}", key, op)


async def _abort(store: Parted, key: str, up: Upload) -> None:
    async def op(s3: Any) -> None:
        await s3.abort_multipart_upload(
            Bucket=store.bucket, Key=store._key(key), UploadId=up.upload_id
        )

    try:
        await store._retry(f"abort upload {key}", key, op)
    except Exception as exc:  # best effort: a lifecycle rule removes what is left
        log.info("abort of the upload of %s failed (%r)", key, exc)


def _code(e: bex.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
