"""Typed settings, read from the environment once at start-up.

Every field documents its variable and default. Secrets (S3 keys, NATS credentials) are
never fields here: they are read from the environment by the client that needs them, so
they cannot leak into a spec, an event or a log line that prints settings.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

import msgspec

from shared.bus import names
from shared.contracts.sites import SITE_NAME
from shared.errors import ConfigError


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    """`NATS_URL`: comma-separated server URLs, as the nats CLI takes them."""
    store_url: str = "file://./.baton/store"
    """`BATON_STORE`: `file:///abs/dir` or `s3://bucket/prefix` (endpoint from
    `BATON_S3_ENDPOINT` or `AWS_ENDPOINT_URL`, keys from the usual AWS variables)."""
    pool: str = "default"
    """`BATON_POOL`: the pool a trainer serves."""
    worker_id: str = ""
    """`BATON_WORKER_ID`: a trainer's stable name; defaults to `<host>-<pid>`."""
    lease_ttl_s: int = 10
    """`BATON_LEASE_TTL`: whole seconds a lease lives without renewal (server clock). Renewed
    every third of it. A link cut shorter than about two thirds of it costs nothing; the run
    of a trainer that died unseen (its host gone) is handed over when its lease expires, and
    at once when a supervisor restarts the trainer."""
    grace_s: float = 30.0
    """`BATON_GRACE`: seconds a preempted (SIGTERMed) trainer gets to checkpoint and commit."""
    work_dir: str = "./.baton/work"
    """`BATON_WORK_DIR`: local scratch for a trainer (run logs, upload spool)."""
    snapshots_dir: str = ""
    """`BATON_SNAPSHOTS`: where the host's trainers keep runs' local snapshots, one
    directory for all of them (`baton.runtime.local`); "" for `/dev/shm/baton-<uid>`."""
    entry_allow: tuple[str, ...] = ()
    """`BATON_ENTRY_ALLOW`: comma-separated module prefixes a trainer may run entry points
    from (`examples,mylab.models`); a job naming any other module is failed before anything
    is imported. Empty allows every module."""
    progress_interval_s: float = 0.5
    """`BATON_PROGRESS_INTERVAL`: least seconds between two progress events of one run."""
    stall_factor: float = 20.0
    """`BATON_STALL_FACTOR`: a run that has not stepped for this many times its median step
    (and at least `BATON_STALL_FLOOR`) is stalled, when its job sets no `stall_timeout_s`
    (`services/trainer/stall.py`): warned of, then, after half as long again, stopped."""
    stall_floor_s: float = 300.0
    """`BATON_STALL_FLOOR`: the least seconds without a step that count as a stall."""
    stall_first_s: float = 1800.0
    """`BATON_STALL_FIRST`: seconds an attempt may take to its first steps (imports, loading
    the checkpoint, the first batches) before it counts as stalled."""
    max_deliver: int = 100
    """`BATON_MAX_DELIVER`: deliveries of one task before the reaper dead-letters it and
    fails its run (preemptions and kills count; failures of user code are `max_retries`)."""
    sweep_interval_s: float = 0.0
    """`BATON_SWEEP_INTERVAL`: seconds between the reaper's sweeps; 0 means TTL/2."""
    gc_age_s: float = 3600.0
    """`BATON_GC_AGE`: uncommitted checkpoint files older than this are garbage."""
    dispatch_concurrency: int = 64
    """`BATON_DISPATCH_CONCURRENCY`: submissions the dispatcher handles at once (each waits
    on a few round trips to NATS, so they overlap); 1 handles them one at a time."""
    heartbeat_s: float = 2.0
    """`BATON_HEARTBEAT`: seconds between a trainer's heartbeats in the worker registry."""
    pulse_s: float = 0.5
    """`BATON_PULSE`: seconds between the pulses a hub trainer sends while it holds a run
    (`services/trainer/pulse.py`): one small core-NATS message, nothing stored."""
    silent_after_s: float = 1.5
    """`BATON_SILENT_AFTER`: seconds without a pulse after which the reaper hands a run over
    (`services/reaper/silences.py`): a host lost costs this, not the lease TTL. 0 turns the
    watch off (the lease's expiry then decides alone)."""
    pools_file: str = ""
    """`BATON_POOLS_FILE`: TOML table of pools (`[pools.<name>] rate_per_hour`,
    `seconds_per_step`) used to estimate cost; measured speeds override it."""
    site: str = ""
    """`BATON_SITE`: the site a trainer or checkpointer runs at — its leaf node's JetStream
    domain, which `NATS_URL` then points at. Empty at the hub."""
    hub_domain: str = "hub"
    """`BATON_HUB_DOMAIN`: the hub's JetStream domain, as a site reaches it."""
    log_level: str = "INFO"
    """`BATON_LOG_LEVEL`: a service's logging level (`DEBUG`, `INFO`, `WARNING`…)."""
    replicas: int = 1
    """`BATON_REPLICAS`: servers of the hub's cluster that keep each stream and bucket; 3 on
    a three-node hub (`baton up --hub-nodes 3` sets it), at most the cluster's size."""
    host_addr: str = "127.0.0.1"
    """`BATON_HOST_ADDR`: the address other hosts reach this trainer's training processes at,
    for runs of several ranks (rank 0's process serves its group's store there). Loopback
    suits one machine (`baton up`); across hosts, this host's address on their network."""
    form_wait_s: float = 30.0
    """`BATON_FORM_WAIT`: seconds a run of several ranks holds its leader's trainer while
    its group forms; then it gives the trainer back for that long times its tries so far (at
    most 10 minutes), so a group that cannot form never keeps other runs off the pool."""
    upload_bps: float = 0.0
    """`BATON_UPLOAD_BPS`: most bytes per second one process sends checkpoint files to an S3
    store at, so that an upload leaves room on a site's uplink for its NATS link (leases,
    pings); `250k`, `1.5M` (powers of 1000, bytes) also do. Per process: a host's training
    processes each get this much. 0 (the default): no cap."""
    retain_ended_s: float = 86400.0
    """`BATON_RETAIN_ENDED`: seconds an ended run's record stays in the runs bucket after
    the reaper archived it; afterwards it is read from the archive (`baton status`,
    `baton runs --all`), which no sweep reads."""
    void_after_s: float = 600.0
    """`BATON_VOID_AFTER`: seconds credits held for a run that has no record (a submission
    whose holds were written and whose record never was) stay held before the reaper gives
    them back (`services/reaper/voids.py`)."""
    alerts_file: str = ""
    """`BATON_ALERTS`: the notifier's TOML file of who is told what (docs/alerts.md);
    `baton up --alerts FILE` sets it."""

    cloud: str = ""
    """`BATON_CLOUD`: `gce`, `aws` or `azure`: the trainer watches its machine's metadata
    server for a reclaim or maintenance notice and drains itself on one
    (`services/trainer/notices.py`). Empty (the default): no watch."""
    metadata_url: str = ""
    """`BATON_METADATA_URL`: the metadata server's address, when not the cloud's own."""
    notice_poll_s: float = 1.0
    """`BATON_NOTICE_POLL`: seconds between two looks at the metadata server."""

    delegate_ahead: tuple[tuple[str, int], ...] = (("*", 1),)
    """`BATON_DELEGATE_AHEAD`: runs the hub grants each site per live trainer of a pool
    beyond the one it trains (`services/dispatcher/delegation.py`): `1`, or per site
    `lab1=2,lab2=0,*=1` (`*`: every other site). 0 grants a site nothing: its trainers take
    the hub's work over the link, as before grants."""
    grant_ahead_s: tuple[tuple[str, float], ...] = ()
    """`BATON_GRANT_AHEAD_S`: grants by time instead (`shared/scheduling/horizon.py`): the
    hub grants a site, per live trainer of a pool, queued work until the expected seconds
    it holds reach this horizon: `1800`, or per site `lab1=3600,lab2=0,*=900`; a pool's
    `grant_ahead_s` (the pools' table) stands for the sites not named. Unset or 0 for a
    site: `BATON_DELEGATE_AHEAD` counts its grants."""

    @property
    def hub_api(self) -> str | None:
        """API prefix for writes into the hub's KV from a site; None at the hub."""
        return f"$JS.{self.hub_domain}.API" if self.site else None

    @property
    def ack_wait_s(self) -> float:
        """AckWait of the task consumers. Longer than the lease TTL so that a blip the lease
        survives never makes JetStream hand the task to someone else."""
        return self.lease_ttl_s * 1.5

    def allows(self, entry_point: str) -> bool:
        module = entry_point.partition(":")[0]
        return not self.entry_allow or any(
            module == p or module.startswith(p + ".") for p in self.entry_allow
        )

    def ahead(self, site: str) -> int:
        table = dict(self.delegate_ahead)
        return table.get(site, table.get("*", 0))

    def horizon(self, site: str, pool: float | None = None) -> float | None:
        """Seconds of expected work per trainer `site` is granted ahead: the site's own
        `BATON_GRANT_AHEAD_S`, else the pool's `grant_ahead_s`, else `*`'s; None (grants
        counted in runs) when none is set or it is 0."""
        table = dict(self.grant_ahead_s)
        found = table.get(site, pool if pool is not None else table.get("*"))
        return found or None

    @property
    def sweep_s(self) -> float:
        return self.sweep_interval_s or self.lease_ttl_s / 2


def load(env: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    d = Settings()
    try:
        return Settings(
            nats_url=env.get("NATS_URL", d.nats_url),
            store_url=env.get("BATON_STORE", d.store_url),
            pool=env.get("BATON_POOL", d.pool),
            worker_id=env.get("BATON_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}",
            lease_ttl_s=_int(env, "BATON_LEASE_TTL", d.lease_ttl_s, minimum=2),
            grace_s=_float(env, "BATON_GRACE", d.grace_s),
            work_dir=env.get("BATON_WORK_DIR", d.work_dir),
            snapshots_dir=env.get("BATON_SNAPSHOTS", d.snapshots_dir),
            entry_allow=tuple(
                p.strip() for p in env.get("BATON_ENTRY_ALLOW", "").split(",") if p.strip()
            ),
            progress_interval_s=_float(env, "BATON_PROGRESS_INTERVAL", d.progress_interval_s),
            stall_factor=_float(env, "BATON_STALL_FACTOR", d.stall_factor),
            stall_floor_s=_float(env, "BATON_STALL_FLOOR", d.stall_floor_s),
            stall_first_s=_float(env, "BATON_STALL_FIRST", d.stall_first_s),
            max_deliver=_int(env, "BATON_MAX_DELIVER", d.max_deliver, minimum=1),
            sweep_interval_s=_float(env, "BATON_SWEEP_INTERVAL", 0.0, allow_zero=True),
            gc_age_s=_float(env, "BATON_GC_AGE", d.gc_age_s),
            heartbeat_s=_float(env, "BATON_HEARTBEAT", d.heartbeat_s),
            pulse_s=_float(env, "BATON_PULSE", d.pulse_s),
            silent_after_s=_float(env, "BATON_SILENT_AFTER", d.silent_after_s, allow_zero=True),
            dispatch_concurrency=_int(
                env, "BATON_DISPATCH_CONCURRENCY", d.dispatch_concurrency, minimum=1
            ),
            pools_file=env.get("BATON_POOLS_FILE", ""),
            site=_site(env.get("BATON_SITE", "")),
            hub_domain=env.get("BATON_HUB_DOMAIN", d.hub_domain),
            log_level=env.get("BATON_LOG_LEVEL", d.log_level),
            replicas=_int(env, "BATON_REPLICAS", d.replicas, minimum=1),
            retain_ended_s=_float(env, "BATON_RETAIN_ENDED", d.retain_ended_s),
            void_after_s=_float(env, "BATON_VOID_AFTER", d.void_after_s),
            host_addr=env.get("BATON_HOST_ADDR", d.host_addr),
            form_wait_s=_float(env, "BATON_FORM_WAIT", d.form_wait_s),
            upload_bps=upload_bps(env),
            alerts_file=env.get("BATON_ALERTS", ""),
            delegate_ahead=_ahead(env.get("BATON_DELEGATE_AHEAD", "1")),
            grant_ahead_s=_horizons(env.get("BATON_GRANT_AHEAD_S", "")),
            cloud=_cloud(env.get("BATON_CLOUD", "")),
            metadata_url=env.get("BATON_METADATA_URL", ""),
            notice_poll_s=_float(env, "BATON_NOTICE_POLL", d.notice_poll_s),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def upload_bps(env: Mapping[str, str]) -> float:
    """`BATON_UPLOAD_BPS` in bytes per second (0: no cap); the S3 store reads it too."""
    raw = env.get("BATON_UPLOAD_BPS", "").strip()
    if not raw:
        return 0.0
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kKmMgG]?)", raw)
    if match is None:  # a ConfigError, not a ValueError: the store reads it outside `load`
        raise ConfigError(f"BATON_UPLOAD_BPS={raw!r} is not bytes per second (`250000`, `250k`)")
    return float(match[1]) * _SCALE[match[2].lower()]


def _cloud(raw: str) -> str:
    cloud = raw.strip().lower()
    if cloud not in ("", "gce", "aws", "azure"):
        raise ValueError(f"BATON_CLOUD={raw!r}: one of gce, aws, azure (or unset)")
    return cloud


def _ahead(raw: str) -> tuple[tuple[str, int], ...]:
    out = []
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        site, _, count = part.rpartition("=")
        site = site.strip() or "*"
        if site != "*":
            _site(site)
        if not count.strip().isdigit() or int(count) > 1000:
            raise ValueError(
                f"BATON_DELEGATE_AHEAD={raw!r}: {part!r} is not `N` or `site=N` (0 to 1000)"
            )
        out.append((site, int(count)))
    return tuple(out)


def _horizons(raw: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        site, _, secs = part.rpartition("=")
        site = site.strip() or "*"
        if site != "*":
            _site(site)
        try:
            value = float(secs)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 30 * 86400:
            raise ValueError(
                f"BATON_GRANT_AHEAD_S={raw!r}: {part!r} is not `SECONDS` or `site=SECONDS` "
                "(0 to 30 days)"
            )
        out.append((site, value))
    return tuple(out)


def _site(raw: str) -> str:
    if raw and (not re.fullmatch(SITE_NAME, raw) or raw == names.HUB_DOMAIN):
        raise ValueError(
            f"BATON_SITE={raw!r} is not a site name: lower-case letters, digits, '-' and '_', "
            f"at most 32, and not {names.HUB_DOMAIN!r}"
        )
    return raw


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ValueError(f"{name}={value} is below the minimum of {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, allow_zero: bool = False) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not (value > 0 or (allow_zero and value == 0)):
        raise ValueError(f"{name}={raw!r} must be positive")
    return value
