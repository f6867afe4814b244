"""One S3 call as `S3Store` makes it: retried while its failure is transient (a timeout, a
dropped connection, 5xx, 409, 429), else named in the error tree (`translate`); and the
store's URL, `s3://bucket[/prefix]`, read (`parse_url`)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import botocore.exceptions as bex

from shared.backoff import Backoff
from shared.checkpoint.store.base import check_key
from shared.errors import (
    ConfigError,
    ContractError,
    IntegrityError,
    NotFound,
    StoreError,
    StoreUnavailable,
)

log = logging.getLogger("baton.store")

T = TypeVar("T")

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

_TRANSPORT = (
    bex.HTTPClientError,
    bex.ConnectionError,
    bex.IncompleteReadError,
    aiohttp.ClientError,
    ConnectionError,
    TimeoutError,
)
# 409 is ConditionalRequestConflict: another conditional write to the key was in flight.
_RETRY_CODES = {"RequestTimeout", "SlowDown", "ConditionalRequestConflict"}
_MISSING_CODES = {"NoSuchKey", "404"}
_DIGEST_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}


def error(e: Exception) -> tuple[int, str]:
    """HTTP status and S3 error code of a refused request; (0, "") for anything else."""
    if not isinstance(e, bex.ClientError):
        return 0, ""
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return int(status), str(e.response.get("Error", {}).get("Code", ""))


def transient(e: Exception) -> bool:
    status, code = error(e)
    if status:
        return status in (409, 429) or status >= 500 or code in _RETRY_CODES
    return isinstance(e, _TRANSPORT)


def describe(e: Exception) -> str:
    status, code = error(e)
    return f"HTTP {status} {code}" if status else type(e).__name__


async def retried(
    s3: Any, failing: str, attempts: int, delays: Backoff, what: str, key: str,
    op: Callable[[Any], Awaitable[T]],
) -> T:  # fmt: skip
    """`op(s3)`, again after each transient failure up to `attempts` times in all, waiting
    `delays` between; a failure that retrying cannot fix raised under the error tree's name
    (`translate`). `failing` names the call in the log (`<store url>: <what>`)."""
    for attempt in range(1, attempts + 1):
        try:
            return await op(s3)
        except Exception as e:
            if not transient(e):
                translated = translate(e, what, key)
                if translated is e:
                    raise
                raise translated from e
            failure = f"{failing} failed ({describe(e)})"
            if attempt == attempts:
                log.warning("%s; giving up after %d attempts", failure, attempt)
                raise StoreUnavailable(
                    f"{failure} {attempt} times; the outcome of a write is unknown"
                ) from e
            log.info("%s, attempt %d/%d", failure, attempt, attempts)
        await asyncio.sleep(delays.next())
    raise AssertionError("unreachable")


def translate(e: Exception, what: str, key: str) -> Exception:
    """The error tree's name for a failure that retrying cannot fix."""
    if isinstance(e, bex.NoCredentialsError | bex.PartialCredentialsError):
        return ConfigError("no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if not isinstance(e, bex.ClientError):
        return e
    _status, code = error(e)
    if code in _MISSING_CODES:
        return NotFound(key)
    if code in _DIGEST_CODES:
        return IntegrityError(f"{what}: the store received other bytes than were hashed")
    return StoreError(f"{what}: {describe(e)}: {e.response.get('Error', {}).get('Message', '')}")


def parse_url(url: str) -> tuple[str, str]:
    """The bucket and prefix of `s3://bucket[/prefix]`, refused (`ConfigError`) when the URL
    holds credentials, a query or a fragment, or names no valid bucket or key."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        # The URL is not echoed: it holds a secret.
        raise ConfigError(
            "credentials do not belong in the store URL; "
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead"
        )
    if parts.scheme != "s3" or not _BUCKET.fullmatch(parts.netloc):
        raise ConfigError(f"invalid S3 store URL {url!r}: use s3://bucket[/prefix]")
    if parts.query or parts.fragment:
        raise ConfigError(f"invalid S3 store URL {url!r}: no query or fragment allowed")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except ContractError as e:
            raise ConfigError(f"invalid S3 store URL {url!r}: {e}") from None
    return parts.netloc, prefix
