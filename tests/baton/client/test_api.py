"""The async Python API against a real nats-server with Baton's streams declared and no
services: a run's record and events are written as the services write them
(`tests/baton/client/runs.py`), and the API reads them back as the CLI would."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.client import Client as Nats

from baton.client import api, watching
from baton.client.api import AsyncClient, job_spec
from baton.client.errors import CliError, InvalidSpec, WaitTimedOut
from baton.stack.natsserver import NatsServer
from shared.contracts import JobSpec, RunState
from shared.contracts.events import Completed, Progress, Started
from tests.baton.client.runs import RUN, SPEC, complete, running

CHARLM = Path(__file__).resolve().parents[3] / "examples" / "charlm.toml"


def test_a_spec_is_a_path_a_dict_or_a_spec_with_fields_replaced() -> None:
    from_file = job_spec(CHARLM, {"steps": 30, "config": {"pace": 0.0}})
    assert from_file.total_steps == 30 and from_file.config == {"pace": 0.0}
    assert from_file.name == "charlm" and from_file.deterministic
    assert job_spec(str(CHARLM)).total_steps == 1500
    assert job_spec({"name": "d", "entry_point": "m:f", "total_steps": 5}).name == "d"
    assert job_spec(SPEC, {"name": "renamed"}) == JobSpec(
        name="renamed", entry_point="m:f", total_steps=10
    )


def test_a_bad_spec_raises_invalid_spec_before_anything_is_sent(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match=r"invalid job spec: .*total_steps") as bad:
        job_spec(SPEC, {"steps": -1})
    assert bad.value.code == 2 and isinstance(bad.value, CliError)
    with pytest.raises(InvalidSpec, match="invalid job spec"):
        job_spec(SPEC, {"no_such_field": 1})
    with pytest.raises(InvalidSpec, match="cannot read"):
        job_spec(tmp_path / "missing.toml")


async def test_status_runs_watch_and_wait_read_what_the_services_wrote(
    nats_server: NatsServer, nc: Nats
) -> None:
    runs = await running(nc)
    async with AsyncClient(nats_server.url) as baton:
        run = baton.run(RUN)
        assert (await run.status()).state is RunState.RUNNING
        assert [r.run_id for r in await baton.runs()] == [RUN]
        with pytest.raises(WaitTimedOut, match=f"run {RUN} is still RUNNING after 0.3 s"):
            await run.wait(timeout=0.3)  # the run goes on
        await complete(nc, runs)
        events = [e async for e in run.watch()]
        assert [type(e) for e in events] == [Started, Progress, Completed], events
        record = await run.wait()
        assert record.state is RunState.COMPLETED and record.digest == "d"
        with pytest.raises(CliError, match=f"run {RUN} is already COMPLETED"):
            await run.cancel("too late")
        with pytest.raises(CliError, match="no run 'r0123456789abcdef9999'") as missing:
            await baton.run("r0123456789abcdef9999").status()
        assert missing.value.code == 3


async def test_watch_ends_on_a_terminal_record_whose_event_never_came(
    nats_server: NatsServer, nc: Nats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watching, "QUIET_S", 0.2)
    runs = await running(nc)
    await complete(nc, runs, event=False)  # its writer died between record and event
    async with AsyncClient(nats_server.url) as baton:
        events = [e async for e in baton.run(RUN).watch()]
        assert [type(e) for e in events] == [Started, Progress], events
        assert (await baton.run(RUN).wait()).state is RunState.COMPLETED


async def test_a_client_not_connected_says_so() -> None:
    with pytest.raises(CliError, match="not connected"):
        await api.AsyncClient("nats://127.0.0.1:1").runs()
