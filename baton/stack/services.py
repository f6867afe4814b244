"""Which services a stack runs, each as a supervised process (`ServiceSpec`): their
environment and credentials, and the order they stop in."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from baton.stack.authority import callout_seed
from baton.stack.options import (
    StackOptions,
    admits_machines,
    devices,
    store_url,
    trainer_count,
    user_of,
    vault,
)
from baton.stack.procs import SERVICE_GRACE_S, TRAINER_GRACE_S, ServiceSpec, StopGroup
from shared import gpus
from shared.auth import (
    DEPARTURES_USER,
    SYSTEM_USER,
)
from shared.config import Settings
from shared.credentials import Vault

# What the trainers take by default; TRAINER_GRACE_S is that plus a margin.
DEFAULT_TRAINER_CHECKPOINT_S: float = Settings().grace_s

SpecBuilder = Callable[[StackOptions, str], list[ServiceSpec]]


def service_specs(opts: StackOptions, nats_url: str) -> list[ServiceSpec]:
    """Dispatcher, checkpointer, reaper (and the notifier, given an alerts file) and the
    trainers, in start order; at a site, its checkpointer, its dispatcher (of the jobs
    submitted there) and trainers (named after the site: worker names are unique
    system-wide)."""
    data = opts.data_dir.absolute()
    trainer = f"{opts.site}-trainer" if opts.site else "trainer"
    hub_services = ["dispatcher", "checkpointer", "reaper"]
    services = ["checkpointer", "dispatcher"] if opts.site else hub_services
    if opts.alerts and not opts.site:
        services.append("notifier")
    if admits_machines(opts):
        services.append("registrar")
    usable = devices(opts)
    trainers = [f"{trainer}-{i}" for i in range(1, trainer_count(opts, usable) + 1)]
    # Trainer N's training processes get GPU N (round-robin past the last one).
    pinned = {t: gpus.pin(usable[i % len(usable)]) for i, t in enumerate(trainers) if usable}
    specs = []
    for name in services + trainers:
        module = "services.trainer" if _is_trainer(name) else f"services.{name}"
        env = {
            "NATS_URL": nats_url,
            "BATON_STORE": store_url(opts),
            "BATON_WORK_DIR": str(data / "work" / name),
            "BATON_WORKER_ID": name,
            "BATON_POOL": opts.pool,
            "PYTHONUNBUFFERED": "1",
        }
        if pythonpath := _pythonpath():
            env["PYTHONPATH"] = pythonpath
        if opts.lease_ttl_s is not None:
            env["BATON_LEASE_TTL"] = str(opts.lease_ttl_s)
        if not opts.site and opts.stream_replicas != 1:
            env["BATON_REPLICAS"] = str(opts.stream_replicas)
        if opts.site:
            env["BATON_SITE"] = opts.site
        if name == "notifier":
            env["BATON_ALERTS"] = str(Path(opts.alerts).absolute())
        env.update(pinned.get(name, {}))
        if (v := vault(opts)) is not None:
            env.update(_credentials(opts, v, name))
        env.update(opts.extra_env)
        # The user's cwd, so that entry points `module:function` next to them import.
        specs.append(
            ServiceSpec(name=name, argv=[sys.executable, "-m", module], env=env, cwd=os.getcwd())
        )
    return specs


def _credentials(opts: StackOptions, v: Vault, name: str) -> dict[str, str]:
    """Where service `name` finds its credentials: files, never the secrets themselves
    (the environment is copied to more places)."""
    user = user_of(opts, "trainer" if _is_trainer(name) else name)
    v.get(user)
    env = {"NATS_AUTH_FILE": str(v.root / f"{user}.env")}
    if name in ("dispatcher", "reaper"):
        # They key the runs' leases (shared/state/lease.py); no one else may know how.
        env["BATON_LEASE_SECRET_FILE"] = str(v.secret("lease"))
    if name == "reaper" and not opts.site:
        # It hears trainers' connections close (services/reaper/departures.py).
        v.get(DEPARTURES_USER)
        env["BATON_DEPARTURES_AUTH_FILE"] = str(v.root / f"{DEPARTURES_USER}.env")
    if name == "registrar":
        # It signs the callout's answers, and closes revoked machines' connections.
        env["BATON_CALLOUT_SEED_FILE"] = str(callout_seed(v))
        v.get(SYSTEM_USER)
        env["BATON_SYSTEM_AUTH_FILE"] = str(v.root / f"{SYSTEM_USER}.env")
        if not opts.site:  # a site has no people
            env["BATON_PEOPLE_DIR"] = str(v.root)
    return env


def _pythonpath() -> str:
    """Run from a checkout that is not pip-installed, the services must still import from
    the same tree as this module. (`-m` puts the cwd first, so user entry points win.)"""
    root = Path(__file__).resolve().parents[1]
    parts = [str(root)] if (root / "services" / "__init__.py").is_file() else []
    if existing := os.environ.get("PYTHONPATH"):
        parts.append(existing)
    return os.pathsep.join(parts)


def _is_trainer(name: str) -> bool:
    return "trainer-" in name


def stop_order(specs: list[ServiceSpec]) -> list[StopGroup]:
    """Trainers first: on SIGTERM each checkpoints its run, and committing that checkpoint
    needs NATS and a live checkpointer, so those must still be there. Then the dispatcher and
    the checkpointer, which by then have nothing left to serve. (The NATS server goes last,
    after the supervisor is done.)"""
    trainers = [s for s in specs if _is_trainer(s.name)]
    others = [s.name for s in specs if not _is_trainer(s.name)]
    grace = max([TRAINER_GRACE_S, *(_trainer_grace(s) for s in trainers)])
    return [StopGroup([s.name for s in trainers], grace), StopGroup(others, SERVICE_GRACE_S)]


def _trainer_grace(spec: ServiceSpec) -> float:
    """A trainer told (by `BATON_GRACE`) to take longer than the default to checkpoint must
    not be SIGKILLed by us before its own deadline."""
    raw = spec.env.get("BATON_GRACE", os.environ.get("BATON_GRACE"))
    try:
        return float(raw) + TRAINER_GRACE_S - DEFAULT_TRAINER_CHECKPOINT_S if raw else 0.0
    except ValueError:
        return 0.0
