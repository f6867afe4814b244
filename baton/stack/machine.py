"""A machine that joined a hub (`baton join`): its identity on disk, and its trainers.

Joining trades a one-time token for the machine's own NATS user and secret, asked of the
hub's registrar (`services/registrar`); everything the machine needs from then on is kept
under its data directory, owner-only:

    <data>/machine.json     the hub's URL, the machine's id and pool, the store, and the
                            environment its trainers share with the hub's (the store's
                            credentials among it)
    <data>/auth/<id>.env    its NATS user and secret (the trainers' `NATS_AUTH_FILE`)
    <data>/logs, run, work  as under `baton up`

Its trainers are `<id>-trainer-<n>`, one per GPU (pinned as `baton up` pins them) or
`CPU_TRAINERS` on a host without one: the only worker ids its credentials may speak for.
`run_machine` supervises them until SIGINT/SIGTERM, then stops them as `baton up` does — each
checkpoints and hands its run over first.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sys
from pathlib import Path

import msgspec

from baton.stack.children import install_stop_signals, remove_stop_signals
from baton.stack.lifecycle import hold_lock
from baton.stack.options import CPU_TRAINERS
from baton.stack.procs import ServiceSpec, Supervisor
from baton.stack.services import _pythonpath, stop_order
from shared import gpus
from shared.contracts.machines import JoinAnswer, JoinRequest

CONFIG = "machine.json"
JOIN_TIMEOUT_S = 30.0
"""How long a join may take: the registrar of a hub just started waits for its store to be
said (`services/registrar`, `STORE_WAIT_S`)."""


class JoinError(RuntimeError):
    """The hub refused the join, or could not be asked; the message says which."""


class MachineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    url: str
    machine: str
    pool: str
    store: str
    trainers: int
    site: str = ""
    """The site it joined at (its URL is that site's leaf node); "" for the hub."""
    env: dict[str, str] = {}
    """The environment the hub hands its machines' trainers (`JoinAnswer.env`)."""


def config_path(data: Path) -> Path:
    return data.absolute() / CONFIG


def load(data: Path) -> MachineConfig | None:
    path = config_path(data)
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=MachineConfig)


async def join(url: str, token: str, data: Path, trainers: int | None = None) -> MachineConfig:
    """Trade `token` for this machine's identity at the hub at `url`, and keep it under
    `data`. Raises JoinError saying why the hub refused."""
    from nats.errors import Error as NatsError

    from shared.bus import names
    from shared.bus.connect import connect
    from shared.contracts import decode, encode
    from shared.credentials import inbox_prefix
    from shared.errors import ConfigError
    from shared.machines.registry import TokenError, joiner_user, parse_token

    try:
        token_id, secret = parse_token(token)
    except TokenError as exc:
        raise JoinError(str(exc)) from None
    usable = gpus.visible(gpus.host_gpus(), os.environ)
    count = trainers if trainers is not None else (len(usable) or CPU_TRAINERS)
    user = joiner_user(token_id)
    options = {
        "user": user,
        "password": secret,
        "inbox_prefix": inbox_prefix(user.replace("-", "_")),
    }
    try:
        nc = await connect(url, "baton-join", first_attempt_timeout=JOIN_TIMEOUT_S, options=options)
    except ConfigError:  # the servers refused the credentials
        raise JoinError(
            "the hub refused the token: it is not one this hub made (mistyped, or forged), "
            "or the hub admits no machines (start it with `baton up --machines`)"
        ) from None
    except (ConnectionError, NatsError, OSError) as exc:
        raise JoinError(f"could not reach the hub at {url}: {exc}") from None
    try:
        ask = JoinRequest(
            host=socket.gethostname(), trainers=count,
            gpus=tuple(g.name for g in usable[:count]),
        )  # fmt: skip
        reply = await nc.request(names.join_subject(token_id), encode(ask), timeout=JOIN_TIMEOUT_S)
        answer = decode(reply.data, JoinAnswer)
    except (NatsError, TimeoutError) as exc:
        raise JoinError(f"the hub's registrar did not answer ({exc}); is it running?") from None
    finally:
        await nc.close()
    if answer.error:
        raise JoinError(f"the hub refused the token: {answer.error}")
    return keep(data, url, answer, count)


def keep(data: Path, url: str, answer: JoinAnswer, trainers: int) -> MachineConfig:
    """Write the machine's identity and settings under `data`, owner-only."""
    assert answer.store is not None, "a join answer without the store"
    auth = data.absolute() / "auth"
    auth.mkdir(parents=True, exist_ok=True)
    os.chmod(auth, 0o700)
    _write_private(
        auth / f"{answer.machine}.env",
        f"NATS_USER={answer.machine}\nNATS_PASSWORD={answer.secret}\n",
    )
    env = dict(answer.env)
    if answer.store.s3_endpoint:
        env.setdefault("BATON_S3_ENDPOINT", answer.store.s3_endpoint)
    conf = MachineConfig(
        url=url, machine=answer.machine, pool=answer.pool, store=answer.store.url,
        trainers=trainers, site=answer.site, env=env,
    )  # fmt: skip
    _write_private(config_path(data), msgspec.json.encode(conf).decode() + "\n")
    return conf


def specs(conf: MachineConfig, data: Path) -> list[ServiceSpec]:
    """The machine's trainers, each pinned to a GPU of its own when there are some."""
    data = data.absolute()
    usable = gpus.visible(gpus.host_gpus(), os.environ)
    out = []
    for i in range(1, conf.trainers + 1):
        name = f"{conf.machine}-trainer-{i}"
        env = {
            "NATS_URL": conf.url,
            "NATS_AUTH_FILE": str(data / "auth" / f"{conf.machine}.env"),
            "BATON_STORE": conf.store,
            "BATON_WORK_DIR": str(data / "work" / name),
            "BATON_WORKER_ID": name,
            "BATON_POOL": conf.pool,
            "PYTHONUNBUFFERED": "1",
            **conf.env,
        }
        if conf.site:
            env["BATON_SITE"] = conf.site
        if pythonpath := _pythonpath():
            env["PYTHONPATH"] = pythonpath
        if usable:
            env.update(gpus.pin(usable[(i - 1) % len(usable)]))
        argv = [sys.executable, "-m", "services.trainer"]
        out.append(ServiceSpec(name=name, argv=argv, env=env, cwd=os.getcwd()))
    return out


async def run_machine(conf: MachineConfig, data: Path, stop: asyncio.Event | None = None) -> int:
    """Run the machine's trainers until SIGINT/SIGTERM (or `stop`); a second signal skips
    their grace. Returns the exit status: 0 after a stop, 3 once the hub refused the
    machine's credentials for `BATON_REVOKED_AFTER` seconds on end (`baton machines
    revoke`)."""
    data = data.absolute()
    (data / "run").mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(data / "run" / "machine.lock")
    except BlockingIOError:
        print(f"error: machine {conf.machine} is running already on {data}", file=sys.stderr,
              flush=True)  # fmt: skip
        return 1
    loop = asyncio.get_running_loop()
    hurry = asyncio.Event()
    own_signals = stop is None
    stop = stop if stop is not None else asyncio.Event()
    if own_signals:
        install_stop_signals(loop, stop, hurry)
    supervisor = Supervisor(data / "logs", data / "run")
    trainers = specs(conf, data)
    revoked = asyncio.Event()
    watch = asyncio.create_task(_watch_identity(conf, data, revoked))
    try:
        await supervisor.start_all(trainers)
        names = ", ".join(s.name for s in trainers)
        at = f"site {conf.site} at {conf.url}" if conf.site else conf.url
        print(f"machine {conf.machine} in pool {conf.pool} at {at}", flush=True)
        print(f"trainers: {names}; logs: {data / 'logs'}", flush=True)
        stopped = asyncio.create_task(stop.wait())
        cut = asyncio.create_task(revoked.wait())
        await asyncio.wait([stopped, cut], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        cut.cancel()
        if revoked.is_set() and not stop.is_set():
            print(
                f"error: the hub refuses machine {conf.machine}'s credentials: it was revoked "
                "(`baton machines revoke`); stopping its trainers",
                file=sys.stderr,
                flush=True,
            )
            hurry.set()  # nothing they checkpoint could be committed now
            return 3
        print("stopping: each trainer checkpoints its run first", file=sys.stderr, flush=True)
        return 0
    finally:
        watch.cancel()
        await asyncio.shield(supervisor.stop(stop_order(trainers), hurry=hurry))
        if own_signals:
            remove_stop_signals(loop)
        lock.close()


REVOKED_AFTER_S = 30.0
"""How long the hub must refuse the machine's credentials, with no login between, before
the machine stops its trainers (`BATON_REVOKED_AFTER`): a registrar restarting refuses for
a moment too."""


def revoked_after_s() -> float:
    raw = os.environ.get("BATON_REVOKED_AFTER", "")
    try:
        return float(raw) if raw else REVOKED_AFTER_S
    except ValueError:
        return REVOKED_AFTER_S


async def _watch_identity(conf: MachineConfig, data: Path, revoked: asyncio.Event) -> None:
    """Hold a connection as the machine, and set `revoked` once every reconnect has been
    refused for `REVOKED_AFTER_S`."""
    import nats

    from shared.credentials import options_for, read_env_file

    creds = read_env_file(data / "auth" / f"{conf.machine}.env")
    refused_since: list[float] = []
    loop = asyncio.get_running_loop()
    patience = revoked_after_s()

    async def on_error(exc: Exception) -> None:
        if "authorization violation" not in str(exc).lower():
            return
        if not refused_since:
            refused_since.append(loop.time())
        elif loop.time() - refused_since[0] >= patience:
            revoked.set()

    async def on_reconnect() -> None:
        refused_since.clear()

    while True:  # the first login too: refused alike when the machine was revoked before
        try:
            nc = await nats.connect(
                conf.url, name=f"baton-machine-{conf.machine}", error_cb=on_error,
                reconnected_cb=on_reconnect, max_reconnect_attempts=-1,
                reconnect_time_wait=1, **options_for(creds),
            )  # fmt: skip
            break
        except Exception as exc:  # nats-py raises its own errors, OSError or a timeout
            await on_error(exc)
            if revoked.is_set():
                return
            await asyncio.sleep(1)  # the pace of a retry, as nats-py's own reconnects
    try:
        await asyncio.Event().wait()
    finally:
        await nc.close()


def systemd_unit(data: Path, baton: list[str]) -> str:
    """A unit that runs the joined machine at boot, as `baton join --data-dir DATA` does."""
    command = " ".join(shlex.quote(a) for a in [*baton, "join", "--data-dir", str(data.absolute())])
    return "\n".join(
        [
            "[Unit]",
            "Description=Baton machine: trainers for a Baton hub",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            f"ExecStart={command}",
            f"WorkingDirectory={data.absolute()}",
            # SIGTERM lets every trainer checkpoint and hand its run over; give it the time.
            "KillMode=mixed",
            "TimeoutStopSec=90",
            "Restart=on-failure",
            "RestartSec=5",
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
