"""Streams, consumers and KV buckets, defined once as code (`shared.bus.layout`,
`shared.bus.consumers`, whose names are here too) and applied idempotently.

`ensure()` creates what is missing and updates what differs. JetStream refuses some
changes in place (a stream's retention or storage); those fail loudly with the field
named, because running against a stale definition would silently break an invariant.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import fields, replace
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    KeyValueConfig,
    StreamConfig,
)
from nats.js.errors import APIError, BadRequestError, NotFoundError

from shared.backoff import Backoff, retrying
from shared.bus.connect import UNAVAILABLE
from shared.bus.consumers import (
    NOTIFIER_MAX_DELIVER,
    cancel_consumer,
    checkpointer_consumer,
    dispatcher_consumer,
    notifier_consumer,
    reaper_consumer,
    reconciler_consumer,
    trainer_consumer,
)
from shared.bus.layout import (
    HUB_API,
    MAX_MSG_BYTES,
    hub_machines,
    kv_configs,
    site_kv_configs,
    site_stream_configs,
    stream_configs,
)
from shared.errors import ConfigError

log = logging.getLogger("baton.streams")

# With the definitions: services declare and bind with this module alone.
__all__ = [
    "HUB_API",
    "MAX_MSG_BYTES",
    "NOTIFIER_MAX_DELIVER",
    "NO_SUITABLE_PEERS",
    "PeersNotBack",
    "cancel_consumer",
    "checkpointer_consumer",
    "declared",
    "dispatcher_consumer",
    "ensure",
    "ensure_consumer",
    "ensure_site",
    "ensure_site_machines",
    "hub_machines",
    "kv_configs",
    "notifier_consumer",
    "reaper_consumer",
    "reconciler_consumer",
    "site_kv_configs",
    "site_stream_configs",
    "stream_configs",
    "trainer_consumer",
]


NO_SUITABLE_PEERS = 10005
"""JetStream's error code for a replicated stream it cannot place: too few peers online."""


class PeersNotBack(Exception):
    """A declaration found too few of the cluster's nodes online to place its replicas."""


async def declared(call: Callable[[], Awaitable[None]], log: logging.Logger) -> None:
    """Run `call`, a service's declarations (`ensure`, its consumers), until JetStream
    answers it. A hub service that started with its cluster — or while too few nodes are
    up — would otherwise exit on its first request (seen in CI: the reaper's first
    STREAM.INFO on a three-node hub just started timed out). Declarations are idempotent,
    so one that landed unanswered is simply found done on the next attempt.

    A cluster whose nodes are coming back answers a replicated declaration with "no
    suitable peers for placement" (10005) until its meta leader has seen enough of them
    online again (seen in the suite, under load: the reaper's bucket declared moments after
    two nodes restarted); that too is waited out."""

    async def attempt() -> None:
        try:
            await call()
        except BadRequestError as exc:
            if exc.err_code != NO_SUITABLE_PEERS:
                raise
            raise PeersNotBack(exc.description or "no suitable peers") from exc

    await retrying(
        attempt,
        retry_on=(*UNAVAILABLE, PeersNotBack),
        what="the hub's JetStream is not answering yet",
        backoff=Backoff(first=0.5, most=5.0),
        log=log,
    )


async def ensure(js: JetStreamContext, replicas: int = 1) -> None:
    """Create or update every stream and bucket Baton needs at the hub, each kept on
    `replicas` servers of the hub's cluster (`Settings.replicas`). A stream declared with
    fewer replicas is scaled up in place (the server copies it to the new peers)."""
    for config in stream_configs():
        await _ensure_stream(js, replace(config, num_replicas=replicas))
    for kv in kv_configs():
        await _ensure_bucket(js, replace(kv, replicas=replicas))


async def ensure_site(js: JetStreamContext, site: str, hub_api: str = HUB_API) -> None:
    """Create or update the streams and buckets of `site`, in its own domain (`js` is the
    site's; `hub_api` the hub's domain as the site reaches it)."""
    for config in site_stream_configs(site, hub_api):
        await _ensure_stream(js, config)
    for kv in site_kv_configs(site):
        await _ensure_bucket(js, kv)


async def ensure_site_machines(js: JetStreamContext, site: str, hub_api: str = HUB_API) -> None:
    """The site's copy of the hub's machine records (`hub_machines`), for its registrar."""
    await _ensure_stream(js, hub_machines(site, hub_api))


async def ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> None:
    assert config.durable_name is not None
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        await js.add_consumer(stream, config)
        return
    differs = _differences(config, info.config)
    if differs:
        log.warning("consumer %s differs (%s); updating", config.durable_name, ", ".join(differs))
        try:
            await js.add_consumer(stream, config)
        except APIError as exc:  # the server answers 400 or 500, depending on the field
            raise ConfigError(
                f"consumer {stream}/{config.durable_name} differs in {differs} and cannot be "
                f"updated in place: {exc.description}"
            ) from None


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
        return
    differs = _differences(config, info.config)
    if not differs:
        return
    log.warning("stream %s differs (%s); updating", config.name, ", ".join(differs))
    # Sources are added at run time, one per linked site (`shared.bus.sourcing`); an update made
    # for another field must not unlink them.
    config = replace(config, sources=config.sources or info.config.sources)
    try:
        await js.update_stream(config)
    except APIError as exc:  # the server answers 400 or 500, depending on the field
        raise ConfigError(
            f"stream {config.name} differs in {differs} and cannot be updated in place: "
            f"{exc.description}"
        ) from None


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> None:
    try:
        info = await js.stream_info(f"KV_{config.bucket}")
    except NotFoundError:
        await js.create_key_value(config)
        return
    if info.config.max_msgs_per_subject != config.history or not info.config.allow_msg_ttl:
        raise ConfigError(
            f"KV bucket {config.bucket} exists with history={info.config.max_msgs_per_subject}"
            f", allow_msg_ttl={info.config.allow_msg_ttl}; expected history={config.history}"
            ", allow_msg_ttl=True. Delete it or point Baton at a fresh server."
        )
    marker_ttl = config.limit_marker_ttl or info.config.subject_delete_marker_ttl
    replicas = config.replicas or 1
    if (
        info.config.subject_delete_marker_ttl != marker_ttl
        or (info.config.num_replicas or 1) != replicas
    ):
        # A bucket declared before expiry markers were used, or on fewer servers: the server
        # changes both in place, keeping every key.
        log.warning("bucket %s differs (markers, replicas); updating", config.bucket)
        await js.update_stream(
            replace(info.config, subject_delete_marker_ttl=marker_ttl, num_replicas=replicas)
        )


def _differences(wanted: Any, actual: Any) -> list[str]:
    """Fields set in `wanted` whose value the server reports differently."""
    out = []
    for f in fields(wanted):
        value = getattr(wanted, f.name)
        if value is None or f.name in ("description",):
            continue
        if getattr(actual, f.name, None) != value:
            out.append(f.name)
    return out
