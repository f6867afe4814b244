"""Writes to a KV bucket as raw JetStream publishes, so that they work from a site too.

nats-py's `kv.put/update/delete` publish to `$KV.<bucket>.<key>`, which does not cross
into another JetStream domain: from a leaf they reach no stream (docs/nats.md). Publishing to
`$JS.<domain>.API.$KV.<bucket>.<key>` does, and the headers give what the client methods
cannot: `Nats-Expected-Last-Subject-Sequence` (compare-and-swap) together with `Nats-TTL`.
Reads need none of this: `nc.jetstream(domain=…).key_value(…)` reads across domains.
"""

from __future__ import annotations

import uuid

from nats.js import JetStreamContext
from nats.js.errors import APIError

from shared.bus.connect import publish

WRONG_LAST_SEQUENCE = (10071, 10164)
"""JetStream's answers to a compare-and-swap that no longer holds: 10071 names the sequence
found, 10164 is the same refusal without it (nats-py's own KV treats both as a lost CAS)."""


class KvWriter:
    """Writes to one bucket; `api_prefix` (`$JS.hub.API`) routes them into another domain."""

    def __init__(self, js: JetStreamContext, bucket: str, api_prefix: str | None = None) -> None:
        self._js = js
        self._root = f"$KV.{bucket}"
        if api_prefix:
            self._root = f"{api_prefix}.{self._root}"

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        expected: int | None = None,
        ttl_s: int | None = None,
        rollup: bool = False,
        attempts: int = 3,
    ) -> int | None:
        """Store `value`; the new revision, or None when `expected` (a CAS on the key's
        last revision, 0 = must not exist) no longer holds. `rollup` drops the key's
        earlier revisions, so that when a `ttl_s` expires nothing older shows through."""
        headers = {}
        if expected is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected)
        if ttl_s is not None:
            headers["Nats-TTL"] = f"{ttl_s}s"
        if rollup:
            headers["Nats-Rollup"] = "sub"
        return await self._write(key, value, headers, attempts)

    async def delete(
        self, key: str, *, expected: int | None, ttl_s: int | None = None, attempts: int = 3
    ) -> bool:
        """Leave a delete marker if the key is still at revision `expected` (None: whatever
        its revision). With `ttl_s` the marker itself goes after that long, leaving nothing
        of the key in the bucket."""
        headers = {"KV-Operation": "DEL"}
        if expected is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected)
        if ttl_s is not None:
            headers["Nats-TTL"] = f"{ttl_s}s"
        return await self._write(key, b"", headers, attempts) is not None

    async def _write(
        self, key: str, value: bytes, headers: dict[str, str], attempts: int
    ) -> int | None:
        try:
            # A fresh id per write: retries of this write are deduplicated by the stream,
            # and the duplicate's ack carries the sequence of the write that landed.
            ack = await publish(
                self._js,
                f"{self._root}.{key}",
                value,
                msg_id=f"kv.{key}.{uuid.uuid4().hex}",
                headers=headers,
                attempts=attempts,
            )
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                return None
            raise
        return int(ack.seq)
