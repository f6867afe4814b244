"""What the hub says of itself to any client (`baton_hub`): where its checkpoint store is.

The hub's checkpointer — the service that owns the store — writes it on start
(`services/checkpointer/service.py`), so a client that has only `NATS_URL` and credentials
finds the store without `--store` (`baton/client/calls.py`, `store_of`). Read by key; the
operator, the dashboard and submitters may read it, only the checkpointer write it
(`shared.auth`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

from shared.bus import names
from shared.contracts import decode, encode
from shared.contracts.checkpoints import StoreInfo

STORE_KEY = "store"


def store_info(url: str, env: Mapping[str, str] = os.environ) -> StoreInfo:
    """The store as this process reaches it, said so any host can: a relative file path
    made absolute, an S3 store with its endpoint."""
    if url.startswith("file://"):
        url = "file://" + str(Path(url.removeprefix("file://")).resolve())
    endpoint = env.get("BATON_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL") or ""
    return StoreInfo(url=url, s3_endpoint=endpoint if url.startswith("s3://") else "")


async def say_store(js: JetStreamContext, info: StoreInfo) -> None:
    kv = await js.key_value(names.HUB_BUCKET)
    await kv.put(STORE_KEY, encode(info))


async def read_store(js: JetStreamContext) -> StoreInfo | None:
    """Where the hub's store is; None when no checkpointer has said so yet (or the hub is
    older than this bucket: asked first, as a direct get to a stream that is not there
    would find no responder, which a patient client waits out)."""
    try:
        await js.stream_info(f"KV_{names.HUB_BUCKET}")
        entry = await js.get_last_msg(
            f"KV_{names.HUB_BUCKET}", f"$KV.{names.HUB_BUCKET}.{STORE_KEY}", direct=True
        )
    except (NotFoundError, KeyNotFoundError, KeyDeletedError):
        return None
    return decode(entry.data, StoreInfo) if entry.data else None
