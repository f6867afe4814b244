"""OpenTelemetry for Baton: one trace per run, and the few numbers an operator watches.

A run's trace crosses four processes (the CLI, the dispatcher, a trainer per attempt, the
checkpointer), and the only thing they share is NATS. So W3C trace context travels in NATS
message headers (`traceparent`, `tracestate`), never in a contract: a Task or CommitRequest
stays the same bytes whether tracing is on or not, and an old reader never sees a field it
does not know. The hops:

    submit (CLI) --submission headers--> dispatch --task headers--> attempt (one per
    attempt; every attempt of a run is a child of the one dispatch, because a redelivered
    task keeps its headers) --> commit (per commit request, publish to outcome)
    --commit request headers--> checkpoint.commit (verify, manifest, CAS)

`setup()` installs real SDK providers in every service even when nothing is exported:
a service must still mint span ids and forward the context, or the next process would
start a new trace. Export happens only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (OTLP over
HTTP/protobuf, the other standard `OTEL_EXPORTER_OTLP_*` variables apply); without it no
exporter exists, so nothing is sent and nothing can fail or log. On a hot path a service
that exports nothing opens no span at all (`consumer_span`): it forwards the context it
received as it is, so the next process's spans hang off the nearest span that is exported,
and the trace stays whole.

Metric instruments are created once, here, from the global meter. Before `setup()` runs (or
in a process that never calls it, like the CLI) they are the API's proxies and cost nothing;
once a MeterProvider is installed the proxies forward to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

log = logging.getLogger("baton.telemetry")

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
FLUSH_TIMEOUT_MS = 5000
"""Shutdown waits at most this long per provider: a collector that is down must not hold
up a trainer that is handing its run to the next worker."""

# Span attribute names, shared so that every service spells them alike.
RUN_ID = "baton.run_id"
WORKER = "baton.worker"
TOKEN = "baton.token"
STEP = "baton.step"
ATTEMPT = "baton.attempt"
START_STEP = "baton.start_step"
OUTCOME = "baton.outcome"
POOL = "baton.pool"
CATEGORY = "baton.category"
CAUSE = "baton.cause"

# A ProxyTracer: it follows whatever provider `setup()` installs later, so modules may hold
# it from import time on.
tracer = trace.get_tracer("baton")

_meter = metrics.get_meter("baton")

# Bucket boundaries: the SDK's default buckets are sized for milliseconds; these are seconds.
_SECONDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900]
_BYTES = [float(4**k * 1024) for k in range(14)]  # 1 KiB .. 64 GiB, ×4 each

STEPS_PER_SECOND = _meter.create_gauge(
    "baton.train.steps_per_second",
    unit="{step}/s",
    description="Training speed of the current attempt, as its progress events report it:"
    " steps since the attempt's first step divided by the time since then.",
)
CHECKPOINT_STALL = _meter.create_histogram(
    "baton.checkpoint.stall",
    unit="s",
    description="Time the training loop was blocked taking one checkpoint (the snapshot"
    " into host buffers; the upload runs in the background).",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
CHECKPOINT_BYTES = _meter.create_histogram(
    "baton.checkpoint.size",
    unit="By",
    description="Total size of the files of one checkpoint a training process wrote.",
    explicit_bucket_boundaries_advisory=_BYTES,
)
COMMIT_LATENCY = _meter.create_histogram(
    "baton.commit.duration",
    unit="s",
    description="From a trainer publishing a commit request to it hearing the"
    " checkpoint_committed event, on the trainer's monotonic clock.",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
RECOVERY = _meter.create_histogram(
    "baton.recovery.duration",
    unit="s",
    description="For an attempt after the run's first: from the trainer beginning the"
    " attempt (lease held) to the training process finishing its first step after"
    " restoring. The wait before the attempt began is not included.",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
CHECKPOINT_AGE = _meter.create_gauge(
    "baton.checkpoint.age",
    unit="s",
    description="Per run in training: seconds since the state its newest committed checkpoint"
    " holds was reached (the attempt's start, for the checkpoint it resumed from): the"
    " training a failure now would lose, its recovery point objective.",
)
STEPS_AT_RISK = _meter.create_gauge(
    "baton.checkpoint.steps_at_risk",
    unit="{step}",
    description="Per run in training: steps done since its newest committed checkpoint.",
)
RUN_RECOVERY = _meter.create_histogram(
    "baton.run.recovery",
    unit="s",
    description="Each interruption of a finished run, by cause (`baton.cause`: preemption,"
    " process kill, host loss, partition, rank loss, failure, divergence, lost run): from its"
    " last step to the next attempt's first step. Exported by the reaper as runs end.",
    explicit_bucket_boundaries_advisory=_SECONDS,
)
REDELIVERIES = _meter.create_counter(
    "baton.task.redeliveries",
    unit="{message}",
    description="Task messages a trainer began an attempt from that JetStream had delivered"
    " before (num_delivered > 1): preemptions, retries, takeovers after a crash.",
)
LEASE_RENEW_FAILURES = _meter.create_counter(
    "baton.lease.renew_failures",
    unit="{renewal}",
    description="Lease renewals that lost their CAS or could not reach NATS.",
)
RUN_SECONDS = _meter.create_counter(
    "baton.run.seconds",
    unit="s",
    description="Wall time of finished runs, by goodput category (`baton.category`:"
    " productive, queued, startup, restore, checkpoint, wasted, recovery, other);"
    " productive over the sum is the fleet's goodput. Exported by the reaper as runs end.",
)
RUN_GOODPUT = _meter.create_histogram(
    "baton.run.goodput",
    unit="1",
    description="Each finished run's goodput: productive seconds over its wall time.",
    explicit_bucket_boundaries_advisory=[0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0],
)
OWNER = "baton.owner"
PREEMPTIONS = _meter.create_counter(
    "baton.scheduler.preemptions",
    unit="{preemption}",
    description="Runs the scheduler asked to make room for another, by rule (`baton.kind`:"
    " priority, quota, fair_share) and by the owner whose run made room (`baton.owner`); the"
    " owner it was made for is `baton.for_owner`.",
)
OWNER_HOLDING = _meter.create_gauge(
    "baton.owner.trainers",
    unit="{trainer}",
    description="Trainers each owner's runs hold in a pool (`baton.owner`, `baton.pool`),"
    " beside `baton.owner.entitled`: the fair share of the pool's trainers it is entitled to.",
)
OWNER_ENTITLED = _meter.create_gauge(
    "baton.owner.entitled",
    unit="{trainer}",
    description="Each owner's fair share of a pool's trainers now, among the owners active"
    " there (`baton.owner`, `baton.pool`).",
)
OWNER_USAGE = _meter.create_gauge(
    "baton.owner.usage",
    unit="s",
    description="Each owner's decayed trainer-seconds in a pool (the fair share's usage).",
)
CREDITS_CHARGED = _meter.create_counter(
    "baton.credits.charged",
    unit="{credit}",
    description="Credits charged as runs are settled, by owner (`baton.owner`) and pool.",
)
_installed: tuple[TracerProvider, MeterProvider] | None = None
_exporting = False
"""Whether spans go anywhere: an exporter or an in-process sink was set up."""


def setup(
    service_name: str,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> None:
    """Install the process's tracer and meter providers. `span_exporter` and
    `metric_reader` add in-process sinks (tests use the SDK's in-memory ones); they are
    synchronous, unlike the OTLP export. A second call changes nothing: the API allows
    setting the global providers only once per process."""
    global _installed
    if _installed is not None:
        log.debug("telemetry already set up; %s keeps the first providers", service_name)
        return
    resource = Resource.create({SERVICE_NAME: service_name})
    tracer_provider = TracerProvider(resource=resource)
    readers: list[MetricReader] = []
    global _exporting
    if span_exporter is not None:
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        _exporting = True
    if metric_reader is not None:
        readers.append(metric_reader)
    if os.environ.get(ENDPOINT_ENV):
        # Imported only here: without an endpoint the exporter is never built, so it can
        # neither connect nor log a failure to.
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # Batched, so a slow collector never blocks the event loop that keeps a lease.
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _exporting = True
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    _installed = (tracer_provider, meter_provider)


def shutdown() -> None:
    """Flush what is batched and stop the exporters; a no-op without `setup()`. Call it
    after the service's work is done (spans of its last commit included)."""
    global _installed
    if _installed is None:
        return
    tracer_provider, meter_provider = _installed
    _installed = None
    tracer_provider.force_flush(FLUSH_TIMEOUT_MS)
    tracer_provider.shutdown()
    meter_provider.shutdown(timeout_millis=FLUSH_TIMEOUT_MS)


@contextlib.contextmanager
def consumer_span(
    name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, str]
) -> Iterator[trace.Span]:
    """The span of a message's handling, continuing the trace in its headers — or, when
    this process exports no spans, no span: the received context made current, so that
    `inject()` forwards it unchanged. A span per message costs the dispatcher an eighth of
    its time at thousands of submissions a second, for a span nobody would see."""
    context = extract(headers)
    if not _exporting:
        token = otel_context.attach(context)
        try:
            yield trace.get_current_span()
        finally:
            otel_context.detach(token)
        return
    with tracer.start_as_current_span(
        name, context=context, kind=trace.SpanKind.CONSUMER, attributes=attributes
    ) as span:
        yield span


def inject(
    headers: Mapping[str, str] | None = None, context: Context | None = None
) -> dict[str, str]:
    """`headers` plus the trace context of `context` (default: the current one), as NATS
    headers. Adds nothing when there is no valid span, so an untraced caller publishes
    exactly what it did before."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier, context=context)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context a message carries (an empty Context when it carries none, so the
    span started from it becomes a new root)."""
    return propagate.extract(headers or {}, getter=_HEADER_GETTER)


class _NatsHeaders(Getter[Mapping[str, str]]):
    """Header names compared case-insensitively: HTTP semantics, which W3C trace context
    assumes, while a NATS client of another language may write `Traceparent`."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            lowered = key.lower()
            value = next((v for k, v in carrier.items() if k.lower() == lowered), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_HEADER_GETTER = _NatsHeaders()
