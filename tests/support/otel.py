"""In-memory OpenTelemetry sinks for the test process. The global providers can be installed
once per process: every test that reads spans or metrics shares these."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import telemetry

_sinks: tuple[InMemorySpanExporter, InMemoryMetricReader] | None = None


def sinks() -> tuple[InMemorySpanExporter, InMemoryMetricReader]:
    global _sinks
    if _sinks is None:
        _sinks = InMemorySpanExporter(), InMemoryMetricReader()
        telemetry.setup("baton-test", span_exporter=_sinks[0], metric_reader=_sinks[1])
    return _sinks


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    if data is None:
        return {}
    return {
        m.name: list(m.data.data_points)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
