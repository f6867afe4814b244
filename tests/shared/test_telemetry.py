"""W3C trace context in NATS headers, and what `setup()` exports (nothing, unless told)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared import telemetry
from shared.bus.connect import publish

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A service's life in miniature: set up, one span, one of each metric kind, shut down.
# Logging at DEBUG to stderr, so that any complaint of the SDK or an exporter shows.
SERVICE = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from shared import telemetry
telemetry.setup("probe")
with telemetry.tracer.start_as_current_span("probe") as span:
    assert span.get_span_context().is_valid, "no SDK tracer provider was installed"
    headers = telemetry.inject({"Nats-Msg-Id": "x"})
    assert "traceparent" in headers, headers
telemetry.CHECKPOINT_BYTES.record(1234)
telemetry.REDELIVERIES.add(1)
telemetry.STEPS_PER_SECOND.set(5.0)
telemetry.shutdown()
print("otlp imported:", "opentelemetry.exporter.otlp.proto.http" in sys.modules)
"""


def _local_span() -> trace.Span:
    # A provider of the test's own, not the global one: the e2e tracing test owns that.
    return TracerProvider().get_tracer("test").start_span("local")


def test_inject_extract_round_trip() -> None:
    span = _local_span()
    sent = span.get_span_context()
    headers = telemetry.inject({"Nats-Msg-Id": "commit.r1.3.10"}, trace.set_span_in_context(span))
    assert headers["Nats-Msg-Id"] == "commit.r1.3.10", headers
    want = f"00-{sent.trace_id:032x}-{sent.span_id:016x}-{sent.trace_flags:02x}"
    assert headers["traceparent"] == want, headers

    got = trace.get_current_span(telemetry.extract(headers)).get_span_context()
    assert got.is_valid and got.is_remote, got
    assert (got.trace_id, got.span_id) == (sent.trace_id, sent.span_id), (got, sent)


def test_tracestate_survives_and_header_case_does_not_matter() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = telemetry.extract({"Traceparent": parent, "TraceState": "baton=1,other=x"})
    got = trace.get_current_span(ctx).get_span_context()
    assert f"{got.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c", got
    assert dict(got.trace_state) == {"baton": "1", "other": "x"}, got.trace_state
    again = telemetry.inject(context=ctx)
    assert again["traceparent"] == parent and again["tracestate"] == "baton=1,other=x", again


def test_no_context_injects_nothing_and_extracts_a_root() -> None:
    assert telemetry.inject({"Nats-Msg-Id": "k"}) == {"Nats-Msg-Id": "k"}
    for headers in (None, {}, {"traceparent": "garbage"}):
        got = trace.get_current_span(telemetry.extract(headers)).get_span_context()
        assert not got.is_valid, (headers, got)


class _FakeJs:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}

    async def publish(self, subject: str, payload: bytes, **kw: Any) -> None:
        self.headers = kw["headers"]


async def test_publish_keeps_msg_id_beside_trace_headers() -> None:
    js = _FakeJs()
    span = _local_span()
    # Headers copied from another message may carry its Nats-Msg-Id: ours must win.
    extra = telemetry.inject({"Nats-Msg-Id": "other"}, trace.set_span_in_context(span))
    await publish(js, "s", b"", msg_id="task.r1.0", headers=extra)  # type: ignore[arg-type]
    assert js.headers["Nats-Msg-Id"] == "task.r1.0", js.headers
    assert js.headers["traceparent"] == extra["traceparent"], js.headers


def _run_service(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SERVICE], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


def test_without_endpoint_nothing_is_exported_or_logged() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = _run_service(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "otlp imported: False", done.stdout
    assert done.stderr == "", done.stderr


class _Collector(http.server.BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Collector.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    _Collector.paths = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_with_endpoint_spans_and_metrics_go_out_over_otlp(collector: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector
    done = _run_service(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "otlp imported: True", done.stdout
    # shutdown() flushed both: the batch of spans and the final metric collection.
    assert sorted(set(_Collector.paths)) == ["/v1/metrics", "/v1/traces"], _Collector.paths
