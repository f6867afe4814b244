"""Who is told what: the alerts file (`BATON_ALERTS`, `baton up --alerts FILE`).

Invariant: a config that loads is whole and valid — every receiver has an http(s) URL, a
known format and known kinds, every pool is named as a pool is or is `"*"`, the site
threshold is positive, there is somebody to tell — and one that does not raises
`ConfigError` naming the key (`pools.gpu.webhooks[1].format`), before the notifier
connects to anything.

    [sites]
    cut_off_s = 300                  # a site silent longer than this is an alert
    # [[sites.webhooks]] …           # who hears of sites; default: pools."*"'s receivers

    [[pools."*".webhooks]]           # every pool without an entry of its own
    url = "https://hooks.slack.com/services/…"
    format = "slack"

    [[pools.gpu.webhooks]]
    url = "http://127.0.0.1:9095/hook"
    format = "alertmanager"          # json (the default) | alertmanager | slack
    kinds = ["failed", "guarded"]    # default: every kind
    name = "oncall"                  # how logs, marks and dead letters name it

A receiver's URL may be a secret (a Slack webhook's path is its credential): it is never
logged nor put in a dead letter; the receiver's `name` is, or else its host and a digest.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path
from typing import Annotated, TypeVar
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from services.notifier.alert import KINDS, Kind
from services.notifier.formats import FORMATS, Format
from shared.contracts import convert
from shared.contracts.jobs import TOKEN
from shared.errors import ConfigError, ContractError

T = TypeVar("T")

DEFAULT_POOL = "*"
CUT_OFF_S = 300.0


class Webhook(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    url: Annotated[str, Meta(min_length=1, max_length=2048)]
    format: Format = "json"
    kinds: list[Kind] | None = None
    name: Annotated[str, Meta(pattern=TOKEN)] | None = None


class PoolAlerts(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    webhooks: list[Webhook] = []


class SiteAlerts(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    cut_off_s: Annotated[float, Meta(gt=0, le=30 * 86400)] = CUT_OFF_S
    webhooks: list[Webhook] | None = None


class AlertsFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pools: dict[str, PoolAlerts] = {}
    sites: SiteAlerts = SiteAlerts()


class Receiver(msgspec.Struct, frozen=True, kw_only=True):
    """A webhook as the notifier uses it."""

    id: str
    """Stable across restarts (its `name`, else a digest of its format and URL): it keys
    the marks of what it was sent, so changing a receiver's URL makes it a new receiver."""
    label: str
    """How logs and dead letters name it: never its URL."""
    url: str
    format: str
    kinds: frozenset[str]


class Alerts(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    pools: dict[str, tuple[Receiver, ...]]
    sites: tuple[Receiver, ...]
    cut_off_s: float

    def receivers(self, pool: str, kind: str) -> tuple[Receiver, ...]:
        """Who hears of `kind` in `pool`: the pool's entry, else `"*"`'s."""
        listed = self.pools.get(pool, self.pools.get(DEFAULT_POOL, ()))
        return tuple(r for r in listed if kind in r.kinds)

    def site_receivers(self) -> tuple[Receiver, ...]:
        return tuple(r for r in self.sites if "site_cut_off" in r.kinds)

    @property
    def count(self) -> int:
        return len({r.id for rs in (*self.pools.values(), self.sites) for r in rs})


def load(path: str) -> Alerts:
    """Read and check the alerts file at `path` (the module's invariant)."""
    if not path:
        raise ConfigError("BATON_ALERTS is not set: the notifier needs an alerts file")
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"alerts file {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"alerts file {path}: not TOML: {exc}") from None
    return parse(raw, path)


def parse(raw: dict[str, object], path: str = "<alerts>") -> Alerts:
    pools_raw = raw.get("pools", {})
    if not isinstance(pools_raw, dict):
        raise ConfigError(f"alerts file {path}: pools: expected a table of pools")
    found = _convert({k: v for k, v in raw.items() if k != "pools"}, AlertsFile, path, "")
    pools: dict[str, tuple[Receiver, ...]] = {}
    for pool, entry in pools_raw.items():
        where = f"pools.{_quoted(pool)}"
        if pool != DEFAULT_POOL and not re.fullmatch(TOKEN, pool):
            raise ConfigError(
                f'alerts file {path}: {where}: not a pool name (letters, digits, "-", "_"; '
                f'or "{DEFAULT_POOL}" for every pool without an entry)'
            )
        hooks = _convert(entry, PoolAlerts, path, where).webhooks
        pools[pool] = _receivers(hooks, f"{where}.webhooks", path)
    default = pools.get(DEFAULT_POOL, ())
    site_hooks = found.sites.webhooks
    sites = default if site_hooks is None else _receivers(site_hooks, "sites.webhooks", path)
    alerts = Alerts(path=path, pools=pools, sites=sites, cut_off_s=found.sites.cut_off_s)
    if alerts.count == 0:
        raise ConfigError(
            f'alerts file {path}: pools: no receiver anywhere; add [[pools."*".webhooks]] '
            'with url = "…"'
        )
    return alerts


_CHOICES = {"format": FORMATS, "kinds": KINDS}


def _convert(raw: object, kind: type[T], path: str, where: str) -> T:
    """`raw` as `kind`, or ConfigError naming the key under `where` and, for a value that
    must be one of a few, which."""
    try:
        return convert(raw, kind)
    except ContractError as exc:
        key = ".".join(p for p in (where, _key(exc.path)) if p) or "(the file)"
        reason = exc.reason
        field = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
        if reason.startswith("Invalid enum value") and field in _CHOICES:
            reason += f"; expected one of {', '.join(_CHOICES[field])}"
        raise ConfigError(f"alerts file {path}: {key}: {reason}") from None


def _receivers(hooks: list[Webhook], where: str, path: str) -> tuple[Receiver, ...]:
    out: dict[str, int] = {}
    made = []
    for i, hook in enumerate(hooks):
        key = f"{where}[{i}]"
        parts = urlsplit(hook.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"alerts file {path}: {key}.url: not an http:// or https:// URL")
        digest = hashlib.sha256(f"{hook.format} {hook.url}".encode()).hexdigest()[:12]
        rid = hook.name or f"h{digest}"
        if rid in out:
            raise ConfigError(
                f"alerts file {path}: {key}: the same receiver as {where}[{out[rid]}]"
                + (" (names must differ)" if hook.name else "")
            )
        out[rid] = i
        kinds = frozenset(hook.kinds if hook.kinds is not None else KINDS)
        label = hook.name or f"{parts.hostname}#{digest[:6]}"
        made.append(Receiver(id=rid, label=label, url=hook.url, format=hook.format, kinds=kinds))
    return tuple(made)


def _key(json_path: str) -> str:
    """`$.webhooks[0].format` as a key of the file, `webhooks[0].format`."""
    return json_path.removeprefix("$").removeprefix(".")


def _quoted(pool: str) -> str:
    return f'"{pool}"' if pool == DEFAULT_POOL else pool
