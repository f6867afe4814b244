"""Machines that join a hub with a token, each as itself, end to end (docs/machines.md).

A hub under `baton up`'s authorization with machines admitted (`--machines`: the registrar
answers the servers' auth callout), its store a real SeaweedFS. Each machine is `baton join`
in its own process tree and data directory, given only the hub's URL and a token: no file of
the hub's. One machine trains a run; a second joins; the first is revoked while it holds the
run — its connections are closed at once, its credentials refused from then on, and the
run, handed over to the second, ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from shared.bus import names
from shared.contracts import RunState
from shared.contracts.events import Progress, Restored, Started
from shared.credentials import options_for, read_env_file
from tests.e2e import jobs
from tests.e2e.jobs import EventLog, finished, submit
from tests.support.audit import Audit
from tests.support.cli import REPO, as_json, run_baton
from tests.support.seaweed import SeaweedS3
from tests.support.sites import Site
from tests.support.stack import Stack, eventually, training_processes

pytestmark = [pytest.mark.timeout(300), pytest.mark.operations]

HUB = ("dispatcher", "checkpointer", "reaper", "registrar")
CLOSED_WITHIN_S = 5.0


def joining_env() -> dict[str, str]:
    """A new machine's environment: nothing of the hub's, no NATS credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "BATON_", "AWS_"))}
    return {
        **env, "PYTHONPATH": str(REPO), "BATON_PROGRESS_INTERVAL": "0.1", "BATON_GRACE": "20",
        "BATON_LOG_LEVEL": "DEBUG", "BATON_REVOKED_AFTER": "2",
    }  # fmt: skip


async def join_once(url: str, token: str, data: Path) -> tuple[int, str]:
    """`baton join` that is expected to be refused: its exit code and what it said."""
    code, out, err = await run_baton(
        "join", url, "--token", token, "--data-dir", str(data), env=joining_env()
    )
    return code, out + err


@contextlib.asynccontextmanager
async def machine(url: str, token: str, data: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """`baton join URL --token T` running in the foreground, stopped however the test ends."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", "join", url, "--token", token, "--data-dir", str(data),
        "--trainers", "1", cwd=REPO, env=joining_env(),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()

        async def none_left() -> bool:
            return not training_processes(data)

        await eventually(none_left, 10, f"the training processes of {data.name} to exit")


async def joined(nc: Client, data: Path) -> tuple[str, str]:
    """The machine's id once it joined, and its trainer's worker id once it heartbeats."""

    async def identity() -> str | None:
        path = data / "machine.json"
        return json.loads(path.read_text())["machine"] if path.exists() else None

    machine_id = await eventually(identity, 60, f"{data.name} to join")
    worker = f"{machine_id}-trainer-1"
    await heard_from(nc, worker)
    return machine_id, worker


async def heard_from(nc: Client, worker: str, timeout: float = 90) -> None:
    """Until `worker` heartbeats (its key in the workers bucket)."""
    kv = await nc.jetstream().key_value(names.WORKERS_BUCKET)

    async def heartbeat() -> bool:
        try:
            return bool((await kv.get(worker)).value)
        except (KeyNotFoundError, KeyDeletedError):
            return False

    await eventually(heartbeat, timeout, f"{worker} to heartbeat")


def connections_of(stack: Stack, user: str) -> int:
    """The hub's connections of `user`, from its monitoring endpoint."""
    port = stack.nats.http_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/connz?auth=1&limit=1024") as r:
        conns = json.loads(r.read())["connections"] or []
    return sum(1 for c in conns if c.get("authorized_user") == user)


async def refused(url: str, data: Path, machine_id: str) -> bool:
    creds = read_env_file(data / "auth" / f"{machine_id}.env")
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **options_for(creds))
    except Exception as exc:
        return "authorization violation" in str(exc).lower()
    await nc.close()
    return False


async def cannot_act_as(url: str, a: Path, a_id: str, b_id: str, b_worker: str) -> list[str]:
    """What A's credentials were refused when acting as B: B's inbox, B's commands, B's
    heartbeat, and listing the leases' keys (a lease is written by naming its key, a MAC
    only the run's task carries: A cannot find B's to renew it)."""
    creds = read_env_file(a / "auth" / f"{a_id}.env")
    errors: list[str] = []

    async def heard(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, error_cb=heard, **options_for(creds))
    try:
        await nc.subscribe(f"_INBOX_{b_id.replace('-', '_')}.>")
        await nc.subscribe(names.control_subject(b_worker))
        await nc.publish(f"$KV.{names.WORKERS_BUCKET}.{b_worker}", b"{}")
        await nc.publish(f"$JS.API.CONSUMER.CREATE.KV_{names.LEASES_BUCKET}", b"{}")
        await nc.flush()

        async def all_refused() -> list[str] | None:
            return errors if len(errors) >= 4 else None

        return await eventually(all_refused, 10, "the server to refuse each")
    finally:
        await nc.close()


async def test_machines_join_with_tokens_train_and_one_revoked_hands_its_run_over(
    tmp_path: Path,
) -> None:
    with SeaweedS3() as s3:
        env = {**s3.env(), "BATON_STORE": s3.url(f"machines-{uuid.uuid4().hex[:8]}")}
        stack = Stack(tmp_path / "hub", trainers=0, machines=True, env=env)
        # This test's own doing: tokens forged, used again, a revoked machine's credentials,
        # and machine A trying to act as machine B.
        stack.audit.allow_server("authentication error|Authorization Violation|Auth callout",
                                 "tokens and credentials refused on purpose")  # fmt: skip
        await stack.start(HUB)
        try:
            nc = await stack.client()
            url = stack.nats.url

            # Tokens refused: altered, malformed, expired.
            a_token = (await as_json(stack, "token", "create", "--ttl", "10m"))["token"]
            forged = a_token[:-4] + ("AAAA" if not a_token.endswith("AAAA") else "BBBB")
            code, said = await join_once(url, forged, tmp_path / "forged")
            assert code == 2 and "not one this hub made" in said, said
            code, said = await join_once(url, "not-a-token", tmp_path / "forged")
            assert code == 2 and "not a join token" in said, said
            short = await as_json(stack, "token", "create", "--ttl", "1s")
            await asyncio.sleep(max(0.0, short["expires_at"] - time.time()) + 0.1)
            code, said = await join_once(url, short["token"], tmp_path / "late")
            assert code == 2 and "expired" in said, said
            assert not (tmp_path / "forged" / "machine.json").exists()

            async with machine(url, a_token, tmp_path / "a") as proc_a:
                a_id, a_worker = await joined(nc, tmp_path / "a")
                # The token again, on another machine: used.
                code, said = await join_once(url, a_token, tmp_path / "again")
                assert code == 2 and f"used already, by machine {a_id}" in said, said

                reference = await submit(
                    nc, jobs.charlm(120, 0.0, name="charlm-m", seed=41, every=50)
                )
                want = (await finished(nc, reference, timeout=120)).digest
                run_id = await submit(
                    nc, jobs.charlm(120, 0.05, name="charlm-m", seed=41, every=50)
                )
                log = EventLog(nc, run_id)
                await log.wait_for(
                    lambda e: isinstance(e, Progress) and e.worker == a_worker and e.step > 20,
                    60, "the run to train on machine A",
                )  # fmt: skip

                b_token = (await as_json(stack, "token", "create"))["token"]
                async with machine(url, b_token, tmp_path / "b"):
                    b_id, b_worker = await joined(nc, tmp_path / "b")
                    stack.audit.allow_server(
                        f'user:{a_id}" - (Subscription|Publish) Violation',
                        "machine A acting as machine B, refused",
                    )
                    refusals = await cannot_act_as(url, tmp_path / "a", a_id, b_id, b_worker)
                    assert all("permissions violation" in r.lower() for r in refusals), refusals

                    listed = {m["machine"]: m for m in await as_json(stack, "machines")}
                    assert listed[a_id]["runs"] == [run_id] and listed[a_id]["state"] == "up"
                    assert listed[b_id]["runs"] == [] and listed[b_id]["state"] == "up"

                    asked = time.monotonic()
                    revoked = await as_json(stack, "machines", "revoke", a_id)
                    assert revoked["machine"] == a_id and revoked["closed"] >= 1
                    assert connections_of(stack, a_id) == 0
                    assert time.monotonic() - asked < CLOSED_WITHIN_S + 10  # the CLI's own start
                    assert await refused(url, tmp_path / "a", a_id)

                    resumed = await log.wait_for(
                        lambda e: isinstance(e, Restored) and e.worker == b_worker, 90,
                        "machine B to resume the run",
                    )  # fmt: skip
                    assert resumed.step > 0
                    done = await finished(nc, run_id, timeout=180)
                    assert done.state is RunState.COMPLETED and done.digest == want
                    listed = {m["machine"]: m for m in await as_json(stack, "machines")}
                    assert listed[a_id]["state"] == "revoked"
                    assert listed[b_id]["state"] == "up"
                    # Nothing else of B's was touched: it still heartbeats, and trains again.
                    again = await submit(
                        nc, jobs.charlm(40, 0.0, name="charlm-m2", seed=5, every=50)
                    )
                    assert (await finished(nc, again, timeout=120)).state is RunState.COMPLETED
                # Machine A, refused from the hub, stopped its trainers by itself.
                assert await asyncio.wait_for(proc_a.wait(), 60) == 3
            Audit(tmp_path / "b").check()
            await machine_at_a_site(stack, nc, tmp_path)
        finally:
            await stack.stop()


async def machine_at_a_site(stack: Stack, nc: Client, tmp_path: Path) -> None:
    """A machine joins site lab1 (its leaf node's own registrar, `services/registrar/site.py`),
    trains a run the hub granted there, logs in there while the link is cut, and, revoked
    at the hub, is closed and refused at the site once the link is back."""
    site = Site(stack, "lab1")
    await site.start(trainers=0)
    url = site.nats.url
    hub_token = (await as_json(stack, "token", "create"))["token"]
    code, said = await join_once(url, hub_token, tmp_path / "wrong-place")
    assert code == 2 and "this token is for the hub, not lab1" in said, said
    token = (await as_json(stack, "token", "create", "--site", "lab1"))["token"]
    code, said = await join_once(stack.nats.url, token, tmp_path / "wrong-place")
    assert code == 2 and "this token is for site lab1" in said, said
    async with machine(url, token, tmp_path / "c") as proc_c:
        c_id, c_worker = await joined(nc, tmp_path / "c")  # its heartbeat came through the outbox
        run_id = await submit(nc, jobs.charlm(40, 0.0, name="charlm-site", seed=7, every=20))
        log = EventLog(nc, run_id)
        done = await finished(nc, run_id, timeout=120)
        assert done.state is RunState.COMPLETED and done.site == "lab1"
        assert {e.worker for e in log.of(Started)} == {c_worker}
        log.close()

        site.proxy.sever()  # cut off: the site admits its machines from its copy of the records
        assert not await refused(url, tmp_path / "c", c_id)
        code, said = await join_once(url, token, tmp_path / "cut")  # joining needs the hub
        assert code == 2 and "cannot reach the hub's registrar" in said, said
        site.proxy.restore()
        await site.linked()

        revoked = await as_json(stack, "machines", "revoke", c_id)
        assert revoked["machine"] == c_id and revoked["site"] == "lab1"
        await eventually(lambda: refused(url, tmp_path / "c", c_id), 30, "the site to refuse C")
        assert await asyncio.wait_for(proc_c.wait(), 60) == 3, "C was not closed at the site"
    Audit(tmp_path / "c").check()
