"""`baton workers` and `baton sites` say how long ago the hub heard each trainer and site by
the hub server's clock: a heartbeat or a site record written 5 minutes ahead or behind is
shown as heard just now — the real commands, against a real nats-server."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from pathlib import Path

from nats.aio.client import Client

from baton.stack.natsserver import NatsServer
from shared.bus import names
from shared.contracts import encode
from shared.contracts.control import WorkerInfo
from shared.contracts.sites import SiteRecord

REPO = Path(__file__).resolve().parents[2]
SKEW = 300.0


async def baton(cwd: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "NO_COLOR": "1"}
    for key in ("NATS_USER", "NATS_PASSWORD", "NATS_AUTH_FILE", "NATS_CREDS", "NATS_URL"):
        env.pop(key, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "baton", *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode()
    return out.decode()


def seen(output: str, name: str) -> float:
    """The age on `name`'s row of a table: its `…s ago` cell."""
    [line] = [line for line in output.splitlines() if f" {name} " in line]
    found = re.search(r"([0-9.]+)s ago", line)
    assert found, line
    return float(found.group(1))


async def test_workers_and_sites_written_5_minutes_off_were_heard_just_now(
    nats_server: NatsServer, declared: Client, tmp_path: Path
) -> None:
    js = declared.jetstream()
    workers = await js.key_value(names.WORKERS_BUCKET)
    sites = await js.key_value(names.SITES_BUCKET)
    for name, off in (("ahead", SKEW), ("behind", -SKEW)):
        at = time.time() + off
        info = WorkerInfo(worker=f"w-{name}", pool="p", host="h", pid=1, device="cpu", at=at)
        await workers.put(info.worker, encode(info))
        record = SiteRecord(site=f"s-{name}", first_seen=at, last_hello=at, linked_at=at)
        await sites.put(record.site, encode(record))

    shown = await baton(tmp_path, "workers", "--server", nats_server.url)
    for name in ("w-ahead", "w-behind"):
        assert 0 <= seen(shown, name) < 60, shown
    shown = await baton(tmp_path, "sites", "--server", nats_server.url)
    for name in ("s-ahead", "s-behind"):
        assert 0 <= seen(shown, name) < 60, shown
