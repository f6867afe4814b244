from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import nats
import pytest

from baton.stack.children import install_stop_signals, remove_stop_signals
from baton.stack.lifecycle import run_stack
from baton.stack.options import StackOptions
from baton.stack.procs import Backoff, ServiceSpec, StopGroup, Supervisor
from baton.stack.services import SpecBuilder, service_specs
from shared.signals import StopRequests
from tests.support.helpers import alive, descendants, read_pid, wait_until

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# A stand-in service. On SIGTERM it appends its name to $RECORD; "stubborn" then keeps
# running (only SIGKILL stops it); "leaky" leaves a grandchild in its process group and exits.
CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys
    name, mode = sys.argv[1], sys.argv[2]
    def on_term(signum, frame):
        with open(os.environ["RECORD"], "a") as f:
            f.write(name + "\\n")
        if mode != "stubborn":
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    if mode.startswith("exit"):
        sys.exit(int(mode[4:]))
    if mode == "leaky":
        grandchild = subprocess.Popen(["sleep", "600"])
        open(os.environ["READY_DIR"] + "/" + name + ".grandchild", "w").write(str(grandchild.pid))
        sys.exit(0)
    open(os.environ["READY_DIR"] + "/" + name, "w").close()
    while True:
        signal.pause()
    """
)


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    (tmp_path / "ready").mkdir()
    return path


def spec(
    tmp_path: Path, child: Path, name: str, mode: str = "wait", restart: bool = True
) -> ServiceSpec:
    env = {"RECORD": str(tmp_path / "record"), "READY_DIR": str(tmp_path / "ready")}
    return ServiceSpec(
        name=name, argv=[sys.executable, str(child), name, mode], env=env, restart=restart
    )


def supervisor(tmp_path: Path, **kw: float) -> Supervisor:
    return Supervisor(tmp_path / "logs", tmp_path / "run", **kw)


def recorded(tmp_path: Path) -> list[str]:
    try:
        return (tmp_path / "record").read_text().split()
    except FileNotFoundError:
        return []


async def wait_ready(tmp_path: Path, *names: str) -> None:
    await wait_until(
        lambda: all((tmp_path / "ready" / n).exists() for n in names), what=f"{names} ready"
    )


def test_backoff_doubles_caps_and_resets_after_uptime() -> None:
    b = Backoff(initial=0.5, maximum=10.0, reset_after=30.0)
    assert [b.after_exit(1.0) for _ in range(7)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert b.after_exit(30.0) == 0.5
    assert b.after_exit(0.1) == 1


async def test_restarts_a_killed_child_with_backoff(
    tmp_path: Path, child: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="baton.procs")
    sup = supervisor(tmp_path)
    pid_file = tmp_path / "run" / "trainer-1.pid"
    try:
        first = await sup.start(spec(tmp_path, child, "trainer-1"))
        assert read_pid(pid_file) == first
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: read_pid(pid_file) not in (None, first), what="restart")
        second = read_pid(pid_file)
        assert second is not None
        os.kill(second, signal.SIGKILL)
        await wait_until(lambda: read_pid(pid_file) not in (None, second), what="2nd restart")
        assert sup.restarts("trainer-1") == 2
    finally:
        await sup.stop()
    assert "trainer-1 exited with -9; restarting in 0.5 s" in caplog.messages
    assert "trainer-1 exited with -9; restarting in 1 s" in caplog.messages
    assert not pid_file.exists()
    assert "starting trainer-1" in (tmp_path / "logs" / "trainer-1.log").read_text()


async def test_crash_loop_backs_off_exponentially_up_to_the_cap(
    tmp_path: Path, child: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="baton.procs")
    sup = supervisor(tmp_path, backoff_initial_s=0.05, backoff_max_s=0.2)
    try:
        await sup.start(spec(tmp_path, child, "crasher", "exit3"))
        await wait_until(lambda: sup.restarts("crasher") >= 4, what="4 restarts")
    finally:
        await sup.stop()
    delays = [m.rsplit(" in ", 1)[1] for m in caplog.messages if "restarting in" in m]
    assert delays[:4] == ["0.05 s", "0.1 s", "0.2 s", "0.2 s"]
    assert caplog.messages.count("crasher exited with 3; restarting in 0.2 s") >= 2


async def test_no_restart_when_not_wanted_and_group_is_swept(tmp_path: Path, child: Path) -> None:
    sup = supervisor(tmp_path)
    grandchild_file = tmp_path / "ready" / "leaky.grandchild"
    try:
        await sup.start(spec(tmp_path, child, "leaky", "leaky", restart=False))
        await wait_until(lambda: sup.returncode("leaky") is not None, what="exit")
        grandchild = read_pid(grandchild_file)
        assert grandchild is not None
        await wait_until(lambda: not alive(grandchild), what="grandchild swept")
        assert sup.restarts("leaky") == 0
        assert sup.pids() == {}
    finally:
        await sup.stop()


async def test_stop_follows_the_order_and_kills_after_grace(tmp_path: Path, child: Path) -> None:
    sup = supervisor(tmp_path)
    await sup.start_all(
        [
            spec(tmp_path, child, "dispatcher"),
            spec(tmp_path, child, "checkpointer"),
            spec(tmp_path, child, "trainer-1"),
            spec(tmp_path, child, "trainer-2", "stubborn"),
            spec(tmp_path, child, "reaper"),
        ]
    )
    await wait_ready(tmp_path, "dispatcher", "checkpointer", "trainer-1", "trainer-2", "reaper")
    pids = sup.pids()
    started = time.monotonic()
    await sup.stop(
        [
            StopGroup(["trainer-1", "trainer-2"], grace_s=0.5),
            StopGroup(["dispatcher", "checkpointer"], grace_s=5.0),
        ]
    )
    order = recorded(tmp_path)
    assert sorted(order[:2]) == ["trainer-1", "trainer-2"]
    assert sorted(order[2:4]) == ["checkpointer", "dispatcher"]
    assert order[4:] == ["reaper"]  # named in no group: stopped last
    assert time.monotonic() - started >= 0.5
    assert sup.returncode("trainer-2") == -signal.SIGKILL
    assert all(sup.returncode(n) == 0 for n in pids if n != "trainer-2")
    assert not any(alive(p) for p in pids.values())
    assert not list((tmp_path / "run").glob("*.pid"))
    await sup.stop()  # idempotent
    with pytest.raises(RuntimeError):
        await sup.start(spec(tmp_path, child, "late"))


async def test_hurry_skips_the_grace(tmp_path: Path, child: Path) -> None:
    sup = supervisor(tmp_path)
    await sup.start(spec(tmp_path, child, "trainer-1", "stubborn"))
    await wait_ready(tmp_path, "trainer-1")
    hurry = asyncio.Event()
    stopping = asyncio.create_task(sup.stop([StopGroup(["trainer-1"], grace_s=120)], hurry=hurry))
    await wait_until(lambda: recorded(tmp_path) == ["trainer-1"], what="SIGTERM seen")
    assert not stopping.done()
    hurry.set()
    await asyncio.wait_for(stopping, 10)
    assert sup.returncode("trainer-1") == -signal.SIGKILL


async def test_no_restart_during_shutdown(tmp_path: Path, child: Path) -> None:
    sup = supervisor(tmp_path)
    await sup.start_all(
        [spec(tmp_path, child, "trainer-1", "stubborn"), spec(tmp_path, child, "checkpointer")]
    )
    await wait_ready(tmp_path, "trainer-1", "checkpointer")
    checkpointer = sup.pid("checkpointer")
    assert checkpointer is not None
    stopping = asyncio.create_task(sup.stop([StopGroup(["trainer-1"], grace_s=120)]))
    await wait_until(lambda: recorded(tmp_path) == ["trainer-1"], what="SIGTERM seen")
    os.kill(checkpointer, signal.SIGKILL)  # dies while the trainer is still stopping
    await wait_until(lambda: sup.returncode("checkpointer") is not None, what="reaped")
    assert sup.pid("checkpointer") is None
    trainer = sup.pid("trainer-1")
    assert trainer is not None
    os.kill(trainer, signal.SIGKILL)
    await asyncio.wait_for(stopping, 10)
    assert sup.restarts("checkpointer") == 0


async def test_stop_signals_set_stop_then_hurry() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hurry = install_stop_signals(loop, stop, min_gap_s=0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await wait_until(stop.is_set, what="stop")
        assert not hurry.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        await wait_until(hurry.is_set, what="hurry")
    finally:
        remove_stop_signals(loop)


def test_a_signal_delivered_twice_at_once_does_not_hurry() -> None:
    requests = StopRequests(asyncio.Event(), asyncio.Event(), min_gap_s=0.5)
    requests.request(100.0)
    requests.request(100.001)  # the same Ctrl-C, relayed to the process and its group
    assert requests.stop.is_set() and not requests.hurry.is_set()
    requests.request(101.0)
    assert requests.hurry.is_set()


SUPERVISOR = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from baton.stack.natsserver import NatsServer
    from baton.stack.procs import ServiceSpec, Supervisor
    # A service stuck in its own graceful stop: it takes SIGTERM and goes on (a trainer
    # waiting for a hung run's checkpoint did); only a SIGKILL ends it.
    STUCK = "import signal\\nsignal.signal(signal.SIGTERM, lambda *_: None)\\n" \\
            "while True: signal.pause()"
    async def main():
        base = Path(sys.argv[1])
        server = NatsServer(base / "nats")
        await server.start()
        (base / "nats.pid").write_text(str(server.pid))
        sup = Supervisor(base / "logs", base / "run")
        for name in ("trainer-1", "checkpointer"):
            await sup.start(ServiceSpec(name=name, argv=[sys.executable, "-c", STUCK]))
        await asyncio.Event().wait()
    asyncio.run(main())
    """
)


async def test_children_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SUPERVISOR,
        str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        run = tmp_path / "run"
        await wait_until(
            lambda: all(read_pid(run / f"{n}.pid") for n in ("trainer-1", "checkpointer")),
            what="children started",
        )
        children = [read_pid(run / f"{n}.pid") for n in ("trainer-1", "checkpointer")]
        children.append(read_pid(tmp_path / "nats.pid"))
        assert all(c is not None and alive(c) for c in children)
        proc.kill()
        await proc.wait()
        await wait_until(
            lambda: not any(c is not None and alive(c) for c in children),
            within=10,
            what="children gone after the supervisor's death",
        )
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# -- baton up, with stand-in services --------------------------------------------------


def stand_ins(tmp_path: Path, child: Path, bad: bool = False) -> SpecBuilder:
    def build(opts: StackOptions, nats_url: str) -> list[ServiceSpec]:
        specs = [spec(tmp_path, child, n) for n in ("dispatcher", "checkpointer", "trainer-1")]
        env = {**specs[0].env, "NATS_URL": nats_url}
        specs = [ServiceSpec(name=s.name, argv=s.argv, env=env) for s in specs]
        if bad:
            specs.append(ServiceSpec(name="trainer-2", argv=[str(tmp_path / "no-such-exe")]))
        return specs

    return build


async def jetstream_answers(url: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=1)
            try:
                await nc.jetstream().account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_stack_starts_prints_and_stops_in_order(tmp_path: Path, child: Path) -> None:
    data = tmp_path / "data"
    out = io.StringIO()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_stack(
            StackOptions(data_dir=data, port=0, ws_port=0, auth=False),
            stop=stop,
            build_specs=stand_ins(tmp_path, child),
            out=out,
        )
    )
    stack_json = data / "run" / "stack.json"
    await wait_until(stack_json.exists, within=30, what="stack.json")
    info = json.loads(stack_json.read_text())
    assert out.getvalue().splitlines()[0] == f"nats: {info['nats_url']}"
    assert info["store_url"] == f"file://{data.absolute() / 'store'}"
    await wait_ready(tmp_path, "dispatcher", "checkpointer", "trainer-1")

    second = await run_stack(
        StackOptions(data_dir=data, port=0, ws_port=0, auth=False),
        stop=asyncio.Event(),
        build_specs=stand_ins(tmp_path, child),
        out=io.StringIO(),
    )
    assert second == 1  # the data dir is taken

    await jetstream_answers(info["nats_url"])
    os.kill(info["pids"]["nats-server"], signal.SIGKILL)  # the stack brings it back
    await wait_until(lambda: not alive(info["pids"]["nats-server"]), what="server killed")
    await jetstream_answers(info["nats_url"], within=30)
    stop.set()
    assert await asyncio.wait_for(task, 60) == 0
    order = recorded(tmp_path)
    assert order[0] == "trainer-1" and sorted(order[1:]) == ["checkpointer", "dispatcher"]
    assert not any(alive(p) for p in info["pids"].values() if p != os.getpid())
    assert not stack_json.exists()


async def test_a_clustered_hub_restarts_the_node_that_died(tmp_path: Path, child: Path) -> None:
    """`--hub-nodes 3`: three servers in one cluster, every URL given out; a SIGKILLed node
    is started again on its store while the others keep serving; all stop with the stack."""
    data = tmp_path / "data"
    out = io.StringIO()
    stop = asyncio.Event()
    opts = StackOptions(data_dir=data, port=0, ws_port=0, auth=False, hub_nodes=3)
    specs = service_specs(opts, "nats://unused")
    assert all(s.env["BATON_REPLICAS"] == "3" for s in specs)
    assert all(s.env["BATON_LEASE_TTL"] == "30" for s in specs)
    task = asyncio.create_task(
        run_stack(opts, stop=stop, build_specs=stand_ins(tmp_path, child), out=out)
    )
    stack_json = data / "run" / "stack.json"
    try:
        await wait_until(stack_json.exists, within=60, what="stack.json")
        info = json.loads(stack_json.read_text())
        urls = info["nats_url"].split(",")
        assert len(urls) == 3 and len(set(urls)) == 3, urls
        assert len(info["sites_url"].split(",")) == 3, info["sites_url"]
        nodes = [info["pids"][f"nats-server-{i}"] for i in (1, 2, 3)]
        assert "hub: 3 nodes, streams and buckets on 3 of them" in out.getvalue()
        for url in urls:
            await jetstream_answers(url, within=30)
        os.kill(nodes[1], signal.SIGKILL)
        await wait_until(lambda: not alive(nodes[1]), what="node 2 killed")
        # The others serve meanwhile (after electing a meta leader if node 2 was it) ...
        await jetstream_answers(urls[0], within=30)
        await jetstream_answers(urls[1], within=60)  # ... and node 2 is back, on its port
    finally:
        stop.set()
        status = await asyncio.wait_for(task, 60)
    assert status == 0
    assert not any(alive(p) for p in nodes)
    assert not stack_json.exists()


async def test_stack_start_failure_stops_what_started(tmp_path: Path, child: Path) -> None:
    before = set(descendants())  # a session's shared servers may run beside this test
    data = tmp_path / "data"
    rc = await run_stack(
        StackOptions(data_dir=data, port=0, ws_port=0, auth=False),
        stop=asyncio.Event(),
        build_specs=stand_ins(tmp_path, child, bad=True),
        out=io.StringIO(),
    )
    assert rc == 1
    for name in ("dispatcher", "checkpointer", "trainer-1"):
        assert (data / "logs" / f"{name}.log").exists()  # they did start...
    assert set(descendants()) <= before  # ...and were all stopped, the NATS server too


async def test_stack_port_taken_fails_cleanly(tmp_path: Path, child: Path) -> None:
    before = set(descendants())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        rc = await run_stack(
            StackOptions(data_dir=tmp_path / "data", port=port, ws_port=0, auth=False),
            stop=asyncio.Event(),
            build_specs=stand_ins(tmp_path, child),
            out=io.StringIO(),
        )
    assert rc == 1
    assert not (tmp_path / "data" / "logs" / "dispatcher.log").exists()
    assert set(descendants()) <= before


UP = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from baton.stack.lifecycle import run_stack
    from baton.stack.options import StackOptions
    from baton.stack.procs import ServiceSpec
    child, base = sys.argv[1], Path(sys.argv[2])
    env = {"RECORD": str(base / "record"), "READY_DIR": str(base / "ready")}
    def build(opts, nats_url):
        return [ServiceSpec(name=n, argv=[sys.executable, child, n, "wait"], env=env)
                for n in ("dispatcher", "checkpointer", "trainer-1")]
    opts = StackOptions(data_dir=base / "data", port=0, ws_port=0, auth=False)
    sys.exit(asyncio.run(run_stack(opts, build_specs=build)))
    """
)


async def test_ctrl_c_reaches_only_the_stack_which_stops_in_order(
    tmp_path: Path, child: Path
) -> None:
    # Its own session stands in for a terminal: Ctrl-C signals the whole foreground group.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        UP,
        str(child),
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        assert proc.stdout is not None
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert first.decode().startswith("nats: nats://127.0.0.1:")
        await wait_ready(tmp_path, "dispatcher", "checkpointer", "trainer-1")
        info = json.loads((tmp_path / "data" / "run" / "stack.json").read_text())
        os.killpg(proc.pid, signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    order = recorded(tmp_path)
    assert order[0] == "trainer-1" and sorted(order[1:]) == ["checkpointer", "dispatcher"]
    assert not any(alive(p) for p in info["pids"].values())
