"""A cloud metadata server on loopback, answering GCE's, AWS's and Azure's documented paths
for the notices a trainer watches (`services/trainer/notices.py`).

Each cloud is served under its own prefix (`url(cloud)` is what `BATON_METADATA_URL` takes)
and asks for its own headers, as the real ones do: GCE `Metadata-Flavor: Google`, AWS an
IMDSv2 session token from `PUT /latest/api/token`, Azure `Metadata: true`. A request
without them is refused (403, 401, 400). The test says what each cloud announces
(`announce`); until then every cloud says nothing is coming.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AWS_TOKEN = "token-of-the-fake-imds"
AZURE_VM = "vm-under-test"


class MetadataServer:
    def __init__(self) -> None:
        self.said: dict[str, str] = {}
        """cloud → what it announces: `reclaim` or `maintenance` (absent: nothing)."""
        self.asked: list[str] = []
        """Paths asked, in order (refused ones too)."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._serve("GET")

            def do_PUT(self) -> None:
                self._serve("PUT")

            def _serve(self, method: str) -> None:
                server.asked.append(self.path)
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, body = server.answer(method, self.path, headers)
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                return None

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    def url(self, cloud: str) -> str:
        port = self._http.server_address[1]
        base = {"gce": "gce/computeMetadata/v1", "aws": "aws", "azure": "azure/metadata"}
        return f"http://127.0.0.1:{port}/{base[cloud]}"

    def announce(self, cloud: str, what: str) -> None:
        assert what in ("reclaim", "maintenance"), what
        self.said[cloud] = what

    def answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        """(status, body) for a request; `headers` by lowercase name (HTTP's are not cased)."""
        cloud, _, rest = path.lstrip("/").partition("/")
        said = self.said.get(cloud, "")
        if cloud == "gce":
            return _gce(rest, headers, said)
        if cloud == "aws":
            return _aws(method, rest, headers, said)
        if cloud == "azure":
            return _azure(rest, headers, said)
        return 404, ""


def _gce(rest: str, headers: dict[str, str], said: str) -> tuple[int, str]:
    if headers.get("metadata-flavor") != "Google":
        return 403, "Missing Metadata-Flavor:Google header."
    if rest == "computeMetadata/v1/instance/preempted":
        return 200, "TRUE" if said == "reclaim" else "FALSE"
    if rest == "computeMetadata/v1/instance/maintenance-event":
        return 200, "TERMINATE_ON_HOST_MAINTENANCE" if said == "maintenance" else "NONE"
    return 404, ""


def _aws(method: str, rest: str, headers: dict[str, str], said: str) -> tuple[int, str]:
    if method == "PUT" and rest == "latest/api/token":
        ttl = "x-aws-ec2-metadata-token-ttl-seconds" in headers
        return (200, AWS_TOKEN) if ttl else (400, "")
    if headers.get("x-aws-ec2-metadata-token") != AWS_TOKEN:
        return 401, ""
    meta = "latest/meta-data/"
    if rest == meta + "spot/instance-action" and said == "reclaim":
        return 200, json.dumps({"action": "terminate", "time": "2026-11-28T20:00:00Z"})
    if rest == meta + "events/recommendations/rebalance" and said == "maintenance":
        return 200, json.dumps({"noticeTime": "2026-11-28T19:58:00Z"})
    return 404, ""


def _azure(rest: str, headers: dict[str, str], said: str) -> tuple[int, str]:
    if headers.get("metadata") != "true":
        return 400, json.dumps({"error": "Required metadata header not specified"})
    if rest.startswith("metadata/instance/compute/name"):
        return 200, AZURE_VM
    if not rest.startswith("metadata/scheduledevents"):
        return 404, ""
    kind = {"reclaim": "Preempt", "maintenance": "Freeze"}.get(said)
    events = []
    if kind:  # another machine's event first: only this one's counts
        events = [
            {"EventId": "A1", "EventType": "Redeploy", "ResourceType": "VirtualMachine",
             "Resources": ["another-vm"], "EventStatus": "Scheduled"},
            {"EventId": "B2", "EventType": kind, "ResourceType": "VirtualMachine",
             "Resources": [AZURE_VM], "EventStatus": "Scheduled",
             "NotBefore": "Sat, 28 Nov 2026 20:00:30 GMT"},
        ]  # fmt: skip
    return 200, json.dumps({"DocumentIncarnation": len(events), "Events": events})
