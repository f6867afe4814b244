"""A real Baton stack for end-to-end tests: nats-server plus each service as a process.

Services are not restarted when they die, so a test that SIGKILLs a trainer knows which
one finishes the run. Everything is stopped in `stop()`, which fixtures call in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import msgspec
from nats.aio.client import Client

from baton.stack.cluster import HubCluster
from baton.stack.natsserver import NatsServer
from baton.stack.options import StackOptions, operator_options
from baton.stack.procs import ServiceSpec, Supervisor
from baton.stack.servers import hub
from baton.stack.services import service_specs, stop_order
from shared.bus.connect import connect
from shared.bus.service import DUMP_SIGNAL
from tests.support.audit import Audit

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


class Stack:
    def __init__(
        self,
        root: Path,
        *,
        trainers: int = 1,
        lease_ttl: int = 4,
        env: dict[str, str] | None = None,
        hub_nodes: int = 1,
        people: tuple[str, ...] = (),
        machines: bool = False,
    ) -> None:
        """`machines`: the hub admits machines that join with a token (start the
        `registrar` with the other services)."""
        self.root = root
        self.opts = StackOptions(
            data_dir=root,
            port=0,
            trainers=trainers,
            lease_ttl=lease_ttl,
            hub_nodes=hub_nodes,
            machines=machines,
            extra_env={
                "BATON_PROGRESS_INTERVAL": "0.1",
                "BATON_GRACE": "20",
                "BATON_LOG_LEVEL": "DEBUG",
                **(env or {}),
            },
        )
        # Auth on, as `baton up` runs: every end-to-end test also checks that each service's
        # permissions give it what it needs. Two sites may join (tests/support/sites.py).
        self.opts = msgspec.structs.replace(
            self.opts, ws_port=0, sites=("lab1", "lab2"), submitters=people
        )
        self.hub: HubCluster = hub(self.opts, http_port=0)
        self.nats: NatsServer = self.hub.nodes[0]
        """The hub's first node (its only one unless `hub_nodes`)."""
        self.sup = Supervisor(root / "logs", root / "run")
        self.specs: list[ServiceSpec] = []
        self.clients: list[Client] = []
        self.after_services: list[Callable[[], Awaitable[None]]] = []
        """Undone after the services stopped, before the hub's server: sites' leaf nodes
        and proxies (see tests/support/sites.py)."""
        self.audit = Audit(root)
        """Read when the stack stops: no permission refused, no JetStream API timeout."""
        self.verify = os.environ.get("BATON_TEST_VERIFY", "0") == "1"
        """Check the stack's whole history with the history checker when it stops
        (`tests/support/verify.py`, docs/verify.md), whatever the test itself asserts:
        `BATON_TEST_VERIFY=1`. Off by default until the checker tells a site's late reports
        from a run going on (docs/verify.md, "Over every test's stack"); the tests of the
        adversary tier, rollbacks and credits check their stacks themselves."""

    @property
    def store_url(self) -> str:
        """The services' store: `BATON_STORE` of the stack's `env`, else its own directory."""
        return self.opts.extra_env.get("BATON_STORE") or f"file://{self.root / 'store'}"

    def lease_key(self, run_id: str) -> str:
        """Where the run's lease lives (the stack's lease secret keys it)."""
        from shared.state.lease import lease_key

        secret = self.root / "auth" / "lease.secret"
        return lease_key(run_id, secret.read_bytes().strip() if secret.exists() else None)

    @property
    def ws_port(self) -> int:
        """The hub's WebSocket port, where sites' leaf nodes connect."""
        assert self.nats.ws_port is not None, "the hub has not been started"
        return self.nats.ws_port

    async def __aenter__(self) -> Stack:
        """`async with Stack(...) as s`: started, and stopped however the block ends (also
        when starting failed part way: what had started is stopped)."""
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(
        self, services: tuple[str, ...] = ("dispatcher", "checkpointer", "reaper", "trainer")
    ) -> None:
        await self.hub.start()
        for spec in service_specs(self.opts, self.hub.url):
            if spec.name.split("-")[0] in services:
                await self.add(spec)
        await self.ready(services)

    async def ready(self, services: tuple[str, ...]) -> None:
        """Wait until the services have declared their streams and consumers."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import NotFoundError, ServiceUnavailableError

        from shared.bus import names

        nc = await self.client()
        js = nc.jetstream()
        wanted = {
            "dispatcher": (names.SUBMIT_STREAM, names.DISPATCHER_CONSUMER),
            "checkpointer": (names.CKPT_STREAM, names.CHECKPOINTER_CONSUMER),
            "trainer": (names.TASKS_STREAM, names.trainer_consumer("default")),
        }

        async def declared() -> bool:
            try:
                for service in services:
                    if service in wanted:
                        await js.consumer_info(*wanted[service])
                await js.stream_info(names.EVENTS_STREAM)
            except NotFoundError:
                return False
            except (NatsTimeout, ServiceUnavailableError):
                return False  # a clustered hub still electing its leaders
            return "registrar" not in services or await registrar_answers(nc)

        await eventually(declared, 30, "services to declare their streams")

    async def add(self, spec: ServiceSpec, *, restart: bool = False) -> int:
        """Start a service; `restart`: as `baton up` does, restart it when it dies (tests
        mostly want a killed service to stay dead)."""
        spec = msgspec.structs.replace(
            spec, restart=restart, cwd=str(Path(__file__).resolve().parents[2])
        )
        self.specs.append(spec)
        return await self.sup.start(spec)

    async def add_trainer(
        self, name: str, env: dict[str, str] | None = None, *, restart: bool = False
    ) -> int:
        one = msgspec.structs.replace(self.opts, trainers=1)
        base = next(s for s in service_specs(one, self.hub.url) if s.name == "trainer-1")
        env = {
            **base.env,
            "BATON_WORKER_ID": name,
            "BATON_WORK_DIR": str(self.root / "work" / name),
            **(env or {}),
        }
        return await self.add(msgspec.structs.replace(base, name=name, env=env), restart=restart)

    def pid(self, name: str) -> int:
        pid = self.sup.pid(name)
        assert pid is not None, f"{name} is not running"
        return pid

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.pid(name), sig)

    async def client(self) -> Client:
        nc = await connect(
            self.hub.url, "test", first_attempt_timeout=10, options=operator_options(self.opts)
        )
        self.clients.append(nc)
        return nc

    async def client_as(self, person: str) -> Client:
        """A client logged in as `person`, one of the stack's `people` (a submitter of its
        own: its runs are `<person>.r…`)."""
        from baton.stack.options import vault
        from shared.credentials import options_for

        v = vault(self.opts)
        assert v is not None and person in self.opts.submitters, person
        nc = await connect(
            self.hub.url, person, first_attempt_timeout=10, options=options_for(v.get(person))
        )
        self.clients.append(nc)
        return nc

    def log(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def dump_trainers(self) -> None:
        """Ask every live trainer to log its asyncio tasks and what each waits in
        (`shared.bus.service.dump_tasks_on_request`): a stuck attempt shows in its log."""
        asked = {}
        for spec in self.specs:
            pid = self.sup.pid(spec.name)
            if pid is not None and "services.trainer" in spec.argv:
                asked[spec.name] = self.log(spec.name).count("tasks, as asked")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, DUMP_SIGNAL)

        async def dumped() -> bool:
            return all(
                self.log(n).count("tasks, as asked") > k or self.sup.pid(n) is None
                for n, k in asked.items()
            )

        with contextlib.suppress(AssertionError):  # a trainer too busy to answer: no dump
            await eventually(dumped, 5, "the trainers' task dumps")

    async def stop(self) -> None:
        found = await self._verified() if self.verify else []
        for nc in self.clients:
            if not nc.is_closed:
                await nc.close()
        # For the post-mortem of a failed test: what every trainer was doing at the end.
        await self.dump_trainers()
        hurry = asyncio.Event()
        hurry.set()  # tests do not wait out graceful shutdowns
        await self.sup.stop(stop_order(self.specs), hurry=hurry)
        for undo in reversed(self.after_services):
            await undo()
        await self.hub.stop()

        # Whatever the test did, no training process may outlive the stack.
        async def none_left() -> bool:
            return not training_processes(self.root)

        await eventually(none_left, 10, "every training process to exit")
        self.audit.check()
        assert not found, "the history breaks invariants:\n" + "\n".join(found)

    async def _verified(self) -> list[str]:
        """The history checker's findings over the stack as it stands (none when its hub
        cannot be read: a test that stopped it)."""
        from tests.support.verify import findings

        try:
            async with asyncio.timeout(60):
                return await findings(self)
        except Exception as exc:  # a hub a test stopped, a store it took away
            print(f"history not checked: {exc!r}")
            return []


async def registrar_answers(nc: Client) -> bool:
    """The registrar answers (whether the hub admits machines)."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from shared.bus import names

    try:
        await nc.request(names.REGISTRAR_HELLO, b"", timeout=2)
    except (NoRespondersError, NatsTimeout):
        return False
    return True


@contextlib.asynccontextmanager
async def named_trainers(
    root: Path, names: Iterable[str], *, restart: bool = False, lease_ttl: int = 3
) -> AsyncIterator[Stack]:
    """A stack under `root` with the hub's services and one trainer per name in `names`
    (each its own process and work directory; `restart`: restarted when it dies, as under
    `baton up`), stopped however the test ends."""
    s = Stack(root / "stack", trainers=0, lease_ttl=lease_ttl)
    try:
        await s.start(("dispatcher", "checkpointer", "reaper"))
        for name in names:
            await s.add_trainer(name, restart=restart)
        await s.ready(("trainer",))
        yield s
    finally:
        await s.stop()


async def eventually(
    check: Callable[[], Awaitable[T | None]], timeout: float, what: str, every: float = 0.1
) -> T:
    """Poll `check` until it returns something other than None/False, or fail after
    `timeout` seconds naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(every)


async def all_dead(pids: list[int], what: str, timeout: float = 10) -> None:
    """Until none of `pids` lives (`what` names them in the failure)."""

    async def gone() -> bool:
        return not any(alive(p) for p in pids)

    await eventually(gone, timeout, what)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks
        return False


def attempt_processes(trainer_pid: int) -> list[int]:
    """A trainer's training processes (and what they spawned), without its zygote, which
    lives as long as the trainer does (services/trainer/zygote.py). The zygote is the
    trainer's own child; the processes it forks carry its command line too, so that alone
    does not tell them apart."""

    def zygote(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"--zygote" in f.read()
        except FileNotFoundError:
            return False

    ours = set(_kids().get(trainer_pid, []))
    return [p for p in children_of(trainer_pid) if not (p in ours and zygote(p))]


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (read from /proc), for asserting no process is left."""
    kids = _kids()
    out, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kids() -> dict[int, list[int]]:
    """Each live process's children, by parent pid (read from /proc)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(")")[-1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def training_processes(root: Path | None = None) -> list[int]:
    """pids of live training child processes (`services.trainer.child`); with `root`, only
    those of the stack under that directory (their environment names it), so that another
    suite running on the same machine does not count. Orphans are re-parented, so the
    environment, not the process tree, is what ties a child to its stack."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"services.trainer.child" not in f.read():
                        continue
                if root is not None:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if str(root).encode() not in f.read():
                            continue
                if alive(int(entry)):
                    found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


SIGKILL = signal.SIGKILL
