"""A cloud's notice that this machine is going, read from its metadata server and obeyed.

Clouds announce a reclaim before it happens, and may never deliver a SIGTERM in time: GCE
sets `instance/preempted` (and `instance/maintenance-event` before host maintenance), AWS
answers `spot/instance-action` two minutes ahead of a spot interruption (and
`events/recommendations/rebalance` when the instance is at raised risk of one), Azure lists
`Preempt` (and `Freeze`, `Reboot`, `Redeploy`, `Terminate`) among its Scheduled Events. With
`BATON_CLOUD` set the trainer looks every `BATON_NOTICE_POLL` seconds (default 1) and, on
the first notice, drains itself: its attempt checkpoints at once and hands the run over (no
step lost), and it takes no new work until the machine goes. Its heartbeat says drained, so
the scheduler no longer counts it. A maintenance event or a rebalance recommendation drains
it the same way: the run moves while the machine is still whole.

The endpoint is overridable (`BATON_METADATA_URL`), so tests answer from a metadata server on
loopback serving each cloud's documented paths. A metadata server that does not answer is
logged once and looked at again; it never stops the trainer. The requests are one local
HTTP GET (AWS: a session token first, IMDSv2), made with the standard library in a worker
thread: nothing here is worth a dependency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from services.trainer.drain import Draining
from shared.config import Settings
from shared.contracts.control import Drain
from shared.logs import Condition
from shared.waits import wait_set

log = logging.getLogger("baton.trainer")

CLOUDS = ("gce", "aws", "azure")
BASE = {
    "gce": "http://metadata.google.internal/computeMetadata/v1",
    "aws": "http://169.254.169.254",
    "azure": "http://169.254.169.254/metadata",
}
"""Each cloud's documented metadata address (`BATON_METADATA_URL` replaces it)."""
READ_S = 2.0
AWS_TOKEN_S = 300
"""The IMDSv2 session token's life asked for; a new one is asked for at half of it."""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Never through an HTTP proxy: the metadata server is this machine's own."""
AZURE_API = "2020-07-01"
AZURE_RECLAIMS = ("Preempt", "Terminate")
AZURE_MAINTENANCE = ("Freeze", "Reboot", "Redeploy")


@dataclass(frozen=True)
class Notice:
    cloud: str
    reclaim: bool
    """The machine is being taken away (else: maintenance, or a raised risk of a reclaim)."""
    detail: str

    @property
    def reason(self) -> str:
        what = "reclaim" if self.reclaim else "maintenance"
        return f"{self.cloud} {what} notice: {self.detail}"


class Metadata:
    """One cloud's metadata server, as the notices are read from it."""

    def __init__(self, cloud: str, base: str = "") -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"BATON_CLOUD={cloud!r}: one of {', '.join(CLOUDS)}")
        self.cloud = cloud
        self.base = (base or BASE[cloud]).rstrip("/")
        self._token = ("", 0.0)
        """AWS: the IMDSv2 session token and when to ask for a new one."""
        self._name = ""
        """Azure: this VM's name, read once."""

    async def look(self) -> Notice | None:
        """The cloud's notice for this machine now, or None."""
        return await asyncio.to_thread(getattr(self, f"_{self.cloud}"))

    def _gce(self) -> Notice | None:
        flavor = {"Metadata-Flavor": "Google"}
        if _request(f"{self.base}/instance/preempted", flavor).strip().upper() == "TRUE":
            return Notice("gce", True, "instance/preempted is TRUE")
        event = _request(f"{self.base}/instance/maintenance-event", flavor).strip()
        if event and event.upper() != "NONE":
            return Notice("gce", False, f"instance/maintenance-event is {event}")
        return None

    def _aws(self) -> Notice | None:
        token, renew_at = self._token
        if time.monotonic() >= renew_at:
            token = _request(
                f"{self.base}/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_S)}, method="PUT",
            ).strip()  # fmt: skip
            self._token = (token, time.monotonic() + AWS_TOKEN_S / 2)
        auth = {"X-aws-ec2-metadata-token": token}
        meta = f"{self.base}/latest/meta-data"
        try:
            action = _request(f"{meta}/spot/instance-action", auth, missing_ok=True)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # the token is no longer good: a new one next look
                self._token = ("", 0.0)
            raise
        if action:
            said = json.loads(action)
            return Notice("aws", True, f"spot {said.get('action')} at {said.get('time')}")
        rebalance = _request(f"{meta}/events/recommendations/rebalance", auth, missing_ok=True)
        if rebalance:
            when = json.loads(rebalance).get("noticeTime")
            return Notice("aws", False, f"rebalance recommendation at {when}")
        return None

    def _azure(self) -> Notice | None:
        headers = {"Metadata": "true"}
        if not self._name:
            self._name = _request(
                f"{self.base}/instance/compute/name?api-version=2021-02-01&format=text",
                headers, missing_ok=True,
            ).strip()  # fmt: skip
        name = self._name
        said = json.loads(_request(f"{self.base}/scheduledevents?api-version={AZURE_API}", headers))
        for event in said.get("Events", []):
            kind, resources = event.get("EventType", ""), event.get("Resources") or []
            if name and resources and name not in resources:
                continue  # another machine of the scale set
            if kind in AZURE_RECLAIMS or kind in AZURE_MAINTENANCE:
                when = event.get("NotBefore") or "now"
                return Notice("azure", kind in AZURE_RECLAIMS, f"{kind} not before {when}")
        return None


async def obeyed(
    settings: Settings, draining: Draining, beat: asyncio.Event, stop: asyncio.Event
) -> None:
    """Watch this machine's metadata server (`BATON_CLOUD`) until `stop`; on a notice,
    drain the trainer and have its heartbeat say so at once (the scheduler counts it out)."""
    metadata = Metadata(settings.cloud, settings.metadata_url)

    def obey(notice: Notice) -> None:
        draining.notice(Drain(worker=settings.worker_id, reason=notice.reason, at=time.time()))
        beat.set()

    await watch(metadata, settings.notice_poll_s, stop, obey)


async def watch(
    metadata: Metadata, every_s: float, stop: asyncio.Event, obey: Callable[[Notice], None]
) -> None:
    """Look every `every_s` until `stop` or a notice, which `obey` is given once."""
    reads = Condition(log, f"reading the {metadata.cloud} metadata server", "looking again")
    while not stop.is_set():
        try:
            notice = await metadata.look()
        except Exception as exc:  # not there, slow, or an answer not as documented
            reads.failed(exc)
        else:
            reads.ok()
            if notice is not None:
                log.warning("%s; handing over what runs and taking no work", notice.reason)
                obey(notice)
                return
        await wait_set(stop, every_s)


def _request(
    url: str, headers: dict[str, str], *, method: str = "GET", missing_ok: bool = False
) -> str:
    """The body of one request; "" for a 404 when `missing_ok` (AWS: no notice)."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with _OPENER.open(req, timeout=READ_S) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and missing_ok:
            return ""
        raise
