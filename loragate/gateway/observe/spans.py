"""The gateway's own OpenTelemetry spans, sent only when an OTLP endpoint is configured.

One trace per inference request, its parent the client's W3C ``traceparent`` (``tracing``):

- ``loragate.request``: the whole request, from its head to the last byte of the answer;
- ``loragate.admit``: where it comes from and the caller's key (``cross_site``, ``auth``);
- ``loragate.check_request``: the body's checks, media fetches included;
- ``loragate.upstream``: the engine exchange until the engine's head (the engine's own spans
  are its children: the engine gets this span as its ``traceparent``), with
  ``loragate.adapter_lease`` inside it (the adapter version leased, or waited for);
- ``loragate.relay``: the answer passed on, from the engine's head to the last byte.

Without an endpoint (``otlp_traces_endpoint``), nothing of OpenTelemetry is imported and each
step costs one ``if`` (``step`` hands back a shared do-nothing context). The SDK and the
OTLP/HTTP exporter come with the ``otel`` extra (vLLM installs them too).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from loragate.settings import Settings

log = logging.getLogger("loragate.gateway")

REQUEST, ADMIT, CHECK, UPSTREAM, LEASE, RELAY = (
    "loragate.request",
    "loragate.admit",
    "loragate.check_request",
    "loragate.upstream",
    "loragate.adapter_lease",
    "loragate.relay",
)

tracer: Any = None  # an OpenTelemetry Tracer while spans are on, else None
_provider: Any = None
_OFF = contextlib.nullcontext()


class _RequestSpans:
    """One request's root span, and when the engine's head came (the relay's start). A mutable
    holder, so a step run in a copied context (a task) still marks it."""

    __slots__ = ("head_ns", "root")

    def __init__(self, root: Any) -> None:
        self.root = root
        self.head_ns: int | None = None


_current: ContextVar[_RequestSpans | None] = ContextVar("loragate_spans", default=None)


def enable_spans(settings: Settings) -> None:
    """Spans on when ``settings`` name an OTLP endpoint (the SDK then imported), else off."""
    global tracer, _provider
    endpoint = settings.otlp_traces_endpoint
    if not endpoint:
        tracer = None
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): "
            "pip install 'loragate[otel]'"
        ) from exc
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the exporter
    # OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT and _COMPRESSION.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "loragate"}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if _provider is not None:
        _provider.shutdown()
    _provider = provider
    tracer = provider.get_tracer("loragate")
    log.info("sending the gateway's spans to %s", endpoint)


def flush_spans(timeout_millis: int = 5000) -> None:
    """Send the spans still batched (tests; the SDK also flushes at exit)."""
    if _provider is not None:
        _provider.force_flush(timeout_millis)


def begin_request(trace: Mapping[str, str] | None) -> dict[str, str]:
    """Open the request's root span, child of the client's valid ``trace`` headers; its own
    trace headers (in the client's trace, or a new one's)."""
    from opentelemetry import context
    from opentelemetry import trace as api
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(trace) if trace else context.Context()
    root = tracer.start_span(REQUEST, context=parent, kind=api.SpanKind.SERVER)
    context.attach(api.set_span_in_context(root, parent))
    _current.set(_RequestSpans(root))
    return outgoing_traceparent()


def step(name: str) -> Any:
    """A child span of the current one, as a ``with`` context; nothing when spans are off."""
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name)


def upstream_step() -> Any:
    """``step(UPSTREAM)``, marking the relay's start when it ends (the engine's head came)."""
    if tracer is None:
        return _OFF
    return _upstream()


@contextlib.contextmanager
def _upstream() -> Any:
    with tracer.start_as_current_span(UPSTREAM):
        yield
    spans = _current.get()
    if spans is not None:
        spans.head_ns = time.time_ns()


def outgoing_traceparent() -> dict[str, str]:
    """The current span as W3C trace headers, for the request to the engine."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier


class ObservedRequest(Protocol):
    """What the root span is told of a finished request: the fields of ``metrics``'
    ``RequestObservation`` it reads, named here so that spans, which ``metrics`` imports,
    imports nothing of ``metrics``."""

    status: int
    stream: bool
    model: str | None
    version: str | None
    request_id: str | None


def end_request(route: str, observation: ObservedRequest) -> None:
    """Close the request's root span (and its relay span) with what the request came to."""
    spans = _current.get()
    if spans is None:
        return
    _current.set(None)
    root, now = spans.root, time.time_ns()
    if spans.head_ns is not None and observation.status == 200:
        from opentelemetry import trace as api

        relay = tracer.start_span(
            RELAY, context=api.set_span_in_context(root), start_time=spans.head_ns
        )
        relay.set_attribute("loragate.stream", bool(observation.stream))
        relay.end(end_time=now)
    root.set_attribute("http.route", route)
    root.set_attribute("http.response.status_code", observation.status)
    if observation.model is not None:
        root.set_attribute("gen_ai.request.model", observation.model)
    if observation.version is not None:
        root.set_attribute("loragate.adapter_version", observation.version)
    if observation.request_id is not None:
        root.set_attribute("loragate.request_id", observation.request_id)
    if observation.status >= 500:
        from opentelemetry.trace import Status, StatusCode

        root.set_status(Status(StatusCode.ERROR))
    root.end(end_time=now)
