"""`baton up` and the CLI as a user runs them: real processes, real signals — and, when
each stack has stopped, nothing refused or timed out in any of its logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.support.audit import Audit
from tests.support.stack import alive, all_dead, attempt_processes, children_of, eventually

REPO = Path(__file__).resolve().parents[2]
JOB = {
    "name": "cli",
    "entry_point": "tests.support.workloads:paced",
    "total_steps": 60,
    "deterministic": True,
    "checkpoint": {"every_steps": 20},
    "config": {"pace": 0.01},
}


async def baton(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton",
        *args,
        cwd=REPO,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start_up(
    data: Path, trainers: int = 1, *more: str
) -> tuple[asyncio.subprocess.Process, str]:
    """`baton up` as a process; returns it and its NATS URL. A hub prints where sites join
    (`hub_ws`), read back from its stack.json."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "baton",
        "up",
        "--data-dir",
        str(data),
        "--port",
        "0",
        "--trainers",
        str(trainers),
        "--lease-ttl",
        "3",
        *(more or ("--ws-port", "0")),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    while line := await asyncio.wait_for(proc.stdout.readline(), 60):
        if line.startswith(b"nats: nats://127.0.0.1:"):
            return proc, line.decode().split()[1]
    raise AssertionError("baton up never printed its nats URL")


async def test_up_runs_a_job_through_the_cli_and_sigterm_leaves_nothing(tmp_path: Path) -> None:
    proc, url = await start_up(tmp_path / "data")
    env = {"NATS_URL": url, "NATS_AUTH_FILE": str(tmp_path / "data" / "auth" / "operator.env")}
    try:
        family = children_of(proc.pid)
        assert len(family) >= 5, family  # nats-server, 4 services (+ a warm training child)
        job = tmp_path / "job.json"
        job.write_text(json.dumps(JOB))
        code, out, err = await baton("submit", str(job), "--json", env=env)
        assert code == 0, err
        run_id = json.loads(out)["run_id"]
        code, out, err = await baton("watch", run_id, env=env)
        assert code == 0, (out, err)
        code, out, _ = await baton("status", run_id, "--json", env=env)
        record = json.loads(out)
        assert record["state"] == "COMPLETED" and record["step"] == 60
        code, out, _ = await baton("runs", "--all", "--json", env=env)
        assert [r["run_id"] for r in json.loads(out)] == [run_id]
        store = f"file://{tmp_path / 'data' / 'store'}"
        code, out, err = await baton(
            "pull", run_id, str(tmp_path / "w"), "--store", store, "--json", env=env
        )
        assert code == 0, err
        assert json.loads(out)["digest"] == record["digest"]
        code, _, err = await baton("status", "rnope", env=env)
        assert code == 3 and "no run" in err
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**JOB, "total_steps": -1}))
        code, _, err = await baton("submit", str(bad), env=env)
        assert code == 2 and "total_steps" in err
        family = children_of(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 90)
    assert proc.returncode == 0

    async def none_left() -> bool:
        return not any(alive(p) for p in family)

    await eventually(none_left, 10, "every process baton up started to exit")
    Audit(tmp_path).check()


async def test_a_second_sigterm_stops_a_trainer_hard_without_an_orphan(tmp_path: Path) -> None:
    proc, url = await start_up(tmp_path / "data")
    try:
        job = tmp_path / "slow.json"
        job.write_text(json.dumps({**JOB, "total_steps": 10_000, "config": {"pace": 0.05}}))
        operator = str(tmp_path / "data" / "auth" / "operator.env")
        code, _out, err = await baton(
            "submit", str(job), "--json", env={"NATS_URL": url, "NATS_AUTH_FILE": operator}
        )
        assert code == 0, err
        pid = int((tmp_path / "data" / "run" / "trainer-1.pid").read_text())

        async def training() -> list[int]:
            kids = children_of(pid)
            return kids if len(kids) >= 1 else []

        family = await eventually(training, 30, "the trainer's training process")
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGTERM)

        async def gone() -> bool:
            return not alive(pid) and not any(alive(p) for p in family)

        await eventually(gone, 15, "the trainer and its training process to exit")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 90)
    Audit(tmp_path).check()


async def test_up_killed_in_its_own_shutdown_leaves_no_process_behind(tmp_path: Path) -> None:
    """What a service manager does once its stop timeout passes: SIGTERM to `baton up`, then
    SIGKILL while it waits for its trainers, one of which trains a run whose loop hangs (it
    cannot checkpoint, so its trainer would wait out its whole grace). Seen before: that
    trainer and its training process outlived `baton up`, re-parented to init."""
    data = tmp_path / "data"
    proc, url = await start_up(data, 2)
    try:
        job = tmp_path / "hangs.json"
        job.write_text(json.dumps({
            **JOB, "entry_point": "tests.support.workloads:stall", "total_steps": 1000,
            "deterministic": False, "config": {"stall_at": 5},
        }))  # fmt: skip
        operator = str(data / "auth" / "operator.env")
        code, _out, err = await baton(
            "submit", str(job), "--json", env={"NATS_URL": url, "NATS_AUTH_FILE": operator}
        )
        assert code == 0, err
        trainers = [int((data / "run" / f"trainer-{n}.pid").read_text()) for n in (1, 2)]

        async def training() -> list[int]:
            return [p for t in trainers for p in attempt_processes(t)]

        await eventually(training, 60, "a training process")
        family = children_of(proc.pid)
        proc.send_signal(signal.SIGTERM)

        async def asked_to_checkpoint() -> bool:
            logs = (data / "logs" / f"trainer-{n}.log" for n in (1, 2))
            return any("checkpointing" in p.read_text() for p in logs)

        await eventually(asked_to_checkpoint, 30, "the trainer to ask its hung run to checkpoint")
        assert proc.returncode is None, "baton up must still be waiting for its trainers"
        proc.kill()
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    await all_dead(family, "every process baton up started to die with it", timeout=20)


async def test_up_site_trains_the_hubs_work_and_baton_sites_shows_it(tmp_path: Path) -> None:
    hub, hub_url = await start_up(tmp_path / "hub", 0, "--ws-port", "0", "--sites", "lab1")
    auth = tmp_path / "hub" / "auth"
    at_hub = {"NATS_URL": hub_url, "NATS_AUTH_FILE": str(auth / "operator.env")}
    procs = [hub]
    try:
        ws = json.loads((tmp_path / "hub" / "run" / "stack.json").read_text())["sites_url"]
        assert ws.startswith("ws://127.0.0.1:"), ws
        store = f"file://{tmp_path / 'hub' / 'store'}"
        code, _, err = await baton("up", "--site", "lab1", env={})
        assert code == 2 and "--hub" in err, err
        code, _, err = await baton(
            "up", "--site", "lab1", "--hub", ws, "--store", store, "--data-dir",
            str(tmp_path / "x"), env={},
        )  # fmt: skip
        assert code == 2 and "--hub-auth" in err, err
        code, _, err = await baton(
            "up", "--site", "lab1", "--hub", ws, "--store", store, "--hub-nodes", "3",
            "--no-auth", "--data-dir", str(tmp_path / "x"), env={},
        )  # fmt: skip
        assert code == 2 and "for the hub, not a site" in err, err
        code, _, err = await baton(
            "up", "--replicas", "3", "--data-dir", str(tmp_path / "x"), env={}
        )
        assert code == 2 and "--replicas 3 needs at least as many --hub-nodes" in err, err
        site, site_url = await start_up(
            tmp_path / "lab1", 1, "--site", "lab1", "--hub", ws, "--store", store,
            "--hub-auth", str(auth / "site-lab1.env"),
        )  # fmt: skip
        procs.append(site)
        job = tmp_path / "job.json"
        job.write_text(json.dumps(JOB))
        # Submitted at the site by its submitter, to the site's own dispatcher, which
        # answers into the site's outbox; the run trains at the site, and the hub knows it
        # once the site's record of it has come across the link.
        code, out, err = await baton(
            "submit", str(job), "--site", "lab1", "--wait", "30", "--json",
            env={
                "NATS_URL": site_url,
                "NATS_AUTH_FILE": str(tmp_path / "lab1" / "auth" / "lab1-submitter.env"),
            },
        )  # fmt: skip
        assert code == 0 and json.loads(out)["accepted"], (out, err)
        run_id = json.loads(out)["run_id"]
        assert run_id.startswith("lab1-submitter."), f"the submitter owns its run: {run_id}"

        async def known_at_hub() -> bool:
            return (await baton("status", run_id, "--json", env=at_hub))[0] == 0

        await eventually(known_at_hub, 30, "the hub to take in the site's run")
        code, out, err = await baton("watch", run_id, env=at_hub)
        assert code == 0, (out, err)
        code, out, _ = await baton("status", run_id, "--json", env=at_hub)
        record = json.loads(out)
        assert record["state"] == "COMPLETED" and record["worker"] is None, record
        code, out, _ = await baton("workers", "--json", env=at_hub)
        assert [w["site"] for w in json.loads(out)] == ["lab1"], out
        code, out, err = await baton("sites", "--json", env=at_hub)
        assert code == 0, err
        [view] = json.loads(out)
        assert view["site"] == "lab1" and view["link"] == "up", view
        family = [p for proc in procs for p in children_of(proc.pid)]
        # The site stops on its own first, at once: its trainer's drain once waited 30 s on
        # a pull subscription left open, and its dispatcher, killed at the end of that,
        # logged a traceback from the connection's drain.
        began = time.monotonic()
        site.send_signal(signal.SIGTERM)
        await asyncio.wait_for(site.wait(), 90)
        took = time.monotonic() - began
        assert took < 10, f"the site took {took:.1f} s to stop"
        logs = {p.name: p.read_text() for p in (tmp_path / "lab1" / "logs").glob("*.log")}
        assert not [name for name, text in logs.items() if "Traceback" in text], logs
    finally:
        for proc in reversed(procs):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 90)
    assert [p.returncode for p in procs] == [0, 0]

    async def none_left() -> bool:
        return not any(alive(p) for p in family)

    await eventually(none_left, 10, "every process both stacks started to exit")
    Audit(tmp_path).check()
