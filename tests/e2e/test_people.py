"""People come and go while `baton up` runs (`baton people`, `baton up --submitter`): the real
command in its own process, a clustered hub (every node must let a person in and out), the
reload asked for by SIGHUP and carried out by the stack itself — no server restarted, a
removed person's open connection closed by the servers, another person's untouched."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shared.credentials import Credentials, read_env_file
from tests.support.audit import Audit
from tests.support.cli import run_baton
from tests.support.logins import Watched, login
from tests.support.stack import alive, children_of, eventually, training_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB = {
    "name": "mine",
    "entry_point": "tests.support.workloads:paced",
    "total_steps": 10,
    "config": {"pace": 0.01},
}


async def baton(*args: str, url: str, auth_file: Path | None = None) -> tuple[int, str, str]:
    """`baton ARGS` as a person runs it: its own process, its own credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env["NATS_URL"] = url
    if auth_file is not None:
        env["NATS_AUTH_FILE"] = str(auth_file)
    return await run_baton(*args, env=env)


async def submit_as(auth_file: Path, job: Path, url: str) -> str:
    """`baton --auth-file FILE submit JOB`: the run id, once a dispatcher accepted it."""
    code, out, err = await baton(
        "--auth-file", str(auth_file), "submit", str(job), "--wait", "30", "--json", url=url
    )
    assert code == 0 and json.loads(out)["accepted"], (out, err)
    return str(json.loads(out)["run_id"])


async def start_up(
    data: Path, said: int, *more: str
) -> tuple[asyncio.subprocess.Process, str]:
    """`baton up --hub-nodes 3 --submitter carol [MORE]` as a process, its stderr to the file
    descriptor `said`: it and its NATS URLs. Stopped here if it never says where it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", "up", "--data-dir", str(data), "--port", "0",
        "--ws-port", "0", "--trainers", "0", "--hub-nodes", "3", "--submitter", "carol", *more,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=said,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        while line := await asyncio.wait_for(proc.stdout.readline(), 120):
            if line.startswith(b"nats: nats://127.0.0.1:"):
                return proc, line.decode().split()[1]
        raise AssertionError("baton up never printed its nats URL")
    except BaseException:
        proc.kill()
        await proc.wait()
        raise


async def stop_up(proc: asyncio.subprocess.Process, watched: list[Watched]) -> None:
    """Close the test's clients, then stop `baton up` as a person does (SIGTERM), killing
    it only if it does not stop."""
    for w in watched:
        if not w.nc.is_closed:
            await w.nc.close()
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_people_are_let_in_and_out_of_a_running_clustered_hub(tmp_path: Path) -> None:
    data = tmp_path / "data"
    auth = data / "auth"
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    audit = Audit(tmp_path)
    said = os.open(tmp_path / "up.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        proc, url = await start_up(data, said)
    finally:
        os.close(said)  # the stack has its own copy
    urls = url.split(",")
    assert len(urls) == 3, urls
    watched: list[Watched] = []
    family: list[int] = []
    try:
        family = children_of(proc.pid)
        pids = json.loads((data / "run" / "stack.json").read_text())["pids"]
        assert json.loads((auth / "people.json").read_text()) == ["carol"]
        carol = await Watched().connect(urls[0], read_env_file(auth / "carol.env"))
        watched.append(carol)
        code, out, err = await baton("people", "list", "--data-dir", str(data), "--json", url=url)
        assert code == 0 and [p["person"] for p in json.loads(out)] == ["carol"], (out, err)

        # alice: added while the stack runs, she logs in and submits as herself.
        code, out, err = await baton(
            "people", "add", "alice", "--data-dir", str(data), "--json", url=url
        )
        assert code == 0, err
        added = json.loads(out)
        assert added == {
            "person": "alice", "added": True, "auth_file": str(auth / "alice.env"),
            "stack": "up",
        }, added  # fmt: skip
        alice_env = auth / "alice.env"
        alice = read_env_file(alice_env)
        assert [await login(u, alice) for u in urls] == ["ok"] * 3, "every node lets her in"
        run_id = await submit_as(alice_env, job, url)
        assert run_id.startswith("alice.r"), f"alice owns her run: {run_id}"
        code, out, err = await baton("status", run_id, "--json", url=url, auth_file=alice_env)
        assert code == 0 and json.loads(out)["run_id"] == run_id, (out, err)
        code, out, err = await baton("people", "add", "alice", "--data-dir", str(data), url=url)
        assert code == 0 and "already a person" in out, (out, err)

        # bob was never added.
        bob = Credentials("bob", "a-guess")
        assert [await login(u, bob) for u in urls] == ["refused"] * 3

        # alice removed: her open connection is closed by the server, her login refused.
        held = await Watched().connect(urls[1], alice)
        watched.append(held)
        code, out, err = await baton(
            "people", "remove", "alice", "--data-dir", str(data), "--json", url=url
        )
        assert code == 0, err
        assert json.loads(out) == {"person": "alice", "removed": True, "stack": "up"}, out
        assert not alice_env.exists()

        async def closed() -> bool:
            return held.nc.is_closed

        await eventually(closed, 10, "the server to close alice's connection")
        assert held.disconnects >= 1, "the test never closed it: the server did"
        assert [await login(u, alice) for u in urls] == ["refused"] * 3
        code, out, err = await baton("people", "remove", "alice", "--data-dir", str(data), url=url)
        assert code == 3 and "no person 'alice'" in err, (out, err)

        # carol, there throughout, never lost her connection, and still submits.
        assert carol.nc.is_connected and carol.disconnects == 0, "carol kept her connection"
        await carol.nc.flush(timeout=5)
        run_id = await submit_as(auth / "carol.env", job, url)
        assert run_id.startswith("carol.r"), f"carol owns her run: {run_id}"
        code, out, err = await baton("people", "list", "--data-dir", str(data), "--json", url=url)
        assert [p["person"] for p in json.loads(out)] == ["carol"], out
        gone = [name for name, pid in pids.items() if not alive(pid)]
        assert not gone, f"restarted: {gone}; a reload restarts nothing"
        log = (tmp_path / "up.stderr").read_text()
        assert "people: alice, carol (every hub node reloaded)" in log, log
        assert "people: carol (every hub node reloaded)" in log, log
        family = children_of(proc.pid)
    finally:
        await stop_up(proc, watched)
    assert proc.returncode == 0

    async def none_left() -> bool:
        return not any(alive(p) for p in family)

    await eventually(none_left, 10, "every process baton up started to exit")
    audit.check()


async def test_a_clustered_hub_that_admits_machines_lets_people_and_machines_in_and_out(
    tmp_path: Path,
) -> None:
    """`baton up --hub-nodes 3 --machines`: every user but the stack's own roles is asked of
    the registrar (NATS's auth callout) at whichever node it reaches — the people, whom the
    servers cannot reload into their callout's bypass list, and a machine that joins with a
    token. A person removed and a machine revoked are closed on every node and refused at
    each from then on; everyone else is untouched."""
    data = tmp_path / "data"
    auth = data / "auth"
    audit = Audit(tmp_path)
    audit.allow_server("authentication error|Authorization Violation|Auth callout",
                       "a removed person's and a revoked machine's logins, refused")  # fmt: skip
    said = os.open(tmp_path / "up.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        proc, url = await start_up(data, said, "--machines")
    finally:
        os.close(said)
    urls = url.split(",")
    operator = auth / "operator.env"
    watched: list[Watched] = []
    joining: asyncio.subprocess.Process | None = None
    machine_dir = tmp_path / "machine"
    try:
        carol = await Watched().connect(urls[0], read_env_file(auth / "carol.env"))
        watched.append(carol)

        code, out, err = await baton(
            "people", "add", "alice", "--data-dir", str(data), "--json", url=url
        )
        assert code == 0, err
        alice = read_env_file(auth / "alice.env")
        assert [await login(u, alice) for u in urls] == ["ok"] * 3, "every node asks for her"
        held = await Watched().connect(urls[1], alice)
        watched.append(held)
        code, out, err = await baton(
            "people", "remove", "alice", "--data-dir", str(data), "--json", url=url
        )
        assert code == 0, err

        async def closed() -> bool:
            return held.nc.is_closed

        await eventually(closed, 10, "alice's connection to be closed")
        assert [await login(u, alice) for u in urls] == ["refused"] * 3

        code, out, err = await baton("token", "create", "--json", url=url, auth_file=operator)
        assert code == 0, err
        token = json.loads(out)["token"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "BATON_"))}
        said_by_join = tmp_path / "join.out"
        with said_by_join.open("wb") as out_file:
            joining = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "baton", "join", urls[2], "--token", token,
                "--data-dir", str(machine_dir), "--trainers", "1", cwd=REPO,
                env={**env, "PYTHONPATH": str(REPO), "BATON_REVOKED_AFTER": "2"},
                stdout=out_file, stderr=subprocess.STDOUT,
            )  # fmt: skip

        async def listed() -> list[dict[str, object]] | None:
            assert joining is not None
            assert joining.returncode is None, said_by_join.read_text()
            code, out, _ = await baton("machines", "--json", url=url, auth_file=operator)
            rows = json.loads(out) if code == 0 else []
            return rows if rows and rows[0]["state"] == "up" else None

        rows = await eventually(listed, 90, "the machine to join and heartbeat")
        machine = str(rows[0]["machine"])
        creds = read_env_file(machine_dir / "auth" / f"{machine}.env")
        assert [await login(u, creds) for u in urls] == ["ok"] * 3, "every node asks for it"

        code, out, err = await baton(
            "machines", "revoke", machine, "--json", url=url, auth_file=operator
        )
        assert code == 0 and json.loads(out)["closed"] >= 1, (out, err)
        assert [await login(u, creds) for u in urls] == ["refused"] * 3
        assert await asyncio.wait_for(joining.wait(), 60) == 3, "it stopped its trainers itself"
        code, out, err = await baton(
            "machines", "revoke", "m-000000000000", url=url, auth_file=operator
        )
        assert code == 2 and "no machine m-000000000000" in err, (out, err)

        assert carol.nc.is_connected and carol.disconnects == 0, "carol kept her connection"
        said = (tmp_path / "up.stderr").read_text()
        assert "people: alice, carol (the registrar admits them)" in said, said
        assert "reloaded" not in said, "no reload: it would ask again about every login"
        family = children_of(proc.pid)
    finally:
        if joining is not None and joining.returncode is None:
            joining.kill()
            await joining.wait()
        await stop_up(proc, watched)
    assert proc.returncode == 0

    async def none_left() -> bool:
        return not any(alive(p) for p in family) and not training_processes(machine_dir)

    await eventually(none_left, 10, "every process baton up and baton join started to exit")
    audit.check()
