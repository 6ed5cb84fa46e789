"""Prometheus metrics: the gateway's own, its engine's state, and the engine's metrics appended.

The text format is written by hand: recording a request is a few dict and list operations
(no locks, no label-object lookups), which keeps the hot path as cheap as the proxy itself,
and a scrape renders everything at once. One ``RequestObservation`` rides along with each
inference request (in a context variable, so the route and the proxy can add to it): the
route names the public model, the proxy adds the time spent waiting on the upstream, and
``RequestObserver`` (a pure ASGI middleware) records status, duration, time to first token
and the gateway's own share of the time when the answer is complete.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loragate import plain_http
from loragate.gateway.engine_metrics import gateway_process_metrics, relabel_engine_metrics
from loragate.gateway.engine_routes import engine_route
from loragate.gateway.traffic import RecentTraffic

if TYPE_CHECKING:
    from loragate.gateway.runtime import Gateway

log = logging.getLogger("loragate.gateway")
access_log = logging.getLogger("loragate.access")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
UNKNOWN_MODEL = "unknown"  # a label value for requests rejected before their model was checked

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


def observed_route(path: str) -> str | None:
    """The route label an inference or engine pass-through request is recorded under (the
    allow-list's template for paths with an id); None for the routes not recorded."""
    if path in INFERENCE_PATHS:
        return path
    route = engine_route(path)
    return route.path if route is not None else None


def route_path(scope: Scope) -> str:
    """The request path inside this app (without the prefix it is mounted under, if any)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequestObservation:
    """What is known about one inference request; filled in as it goes."""

    __slots__ = (
        "finished",
        "first_byte",
        "model",
        "request_id",
        "started",
        "status",
        "stream",
        "trace_id",
        "upstream_seconds",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.model: str | None = None
        self.request_id: str | None = None
        self.trace_id: str | None = None
        self.stream = False
        self.status = 0
        self.first_byte = 0.0
        self.finished = 0.0
        self.upstream_seconds = 0.0


current_observation: ContextVar[RequestObservation | None] = ContextVar(
    "loragate_request_observation", default=None
)


class Histogram:
    """Cumulative-on-render bucket counts, a sum and a count."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def lines(self, name: str, labels: str) -> Iterable[str]:
        sep = "," if labels else ""
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            yield f'{name}_bucket{{{labels}{sep}le="{_number(bound)}"}} {running}'
        yield f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}'
        suffix = f"{{{labels}}}" if labels else ""
        yield f"{name}_sum{suffix} {_number(self.total)}"
        yield f"{name}_count{suffix} {self.count}"


class GatewayMetrics:
    """The gateway's request metrics, recorded per request and rendered on scrape."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.duration: dict[tuple[str, str], Histogram] = {}
        self.ttft: dict[str, Histogram] = {}
        self.overhead = Histogram(OVERHEAD_BUCKETS)
        self.in_flight = 0
        self.recent = RecentTraffic()  # the last minutes, second by second (the status page)

    def record(self, route: str, observation: RequestObservation, ended: float) -> None:
        model = observation.model or UNKNOWN_MODEL
        key = (route, model, observation.status)
        self.requests[key] = self.requests.get(key, 0) + 1
        elapsed = ended - observation.started
        histogram = self.duration.get((route, model))
        if histogram is None:
            histogram = self.duration[(route, model)] = Histogram(LATENCY_BUCKETS)
        histogram.observe(elapsed)
        first_token: float | None = None
        if observation.stream and observation.first_byte and observation.status == 200:
            ttft = self.ttft.get(model)
            if ttft is None:
                ttft = self.ttft[model] = Histogram(LATENCY_BUCKETS)
            first_token = observation.first_byte - observation.started
            ttft.observe(first_token)
        self.recent.add(observation.status, elapsed, first_token)
        if observation.upstream_seconds > 0.0:
            self.overhead.observe(max(0.0, elapsed - observation.upstream_seconds))

    def render(self) -> list[str]:
        out = [
            "# HELP loragate_requests_total Inference requests answered, by route, public model and HTTP status.",
            "# TYPE loragate_requests_total counter",
        ]
        for (route, model, status), count in sorted(self.requests.items()):
            out.append(
                f'loragate_requests_total{{route="{route}",model="{_label(model)}",status="{status}"}} {count}'
            )
        out += [
            "# HELP loragate_request_duration_seconds Time from request to the end of the answer.",
            "# TYPE loragate_request_duration_seconds histogram",
        ]
        for (route, model), histogram in sorted(self.duration.items()):
            out += histogram.lines(
                "loragate_request_duration_seconds", f'route="{route}",model="{_label(model)}"'
            )
        out += [
            "# HELP loragate_time_to_first_token_seconds Streamed requests: time to the first event.",
            "# TYPE loragate_time_to_first_token_seconds histogram",
        ]
        for model, histogram in sorted(self.ttft.items()):
            out += histogram.lines(
                "loragate_time_to_first_token_seconds", f'model="{_label(model)}"'
            )
        out += [
            "# HELP loragate_gateway_overhead_seconds Time a proxied request spent in the gateway itself (its duration minus the upstream's).",
            "# TYPE loragate_gateway_overhead_seconds histogram",
            *self.overhead.lines("loragate_gateway_overhead_seconds", ""),
            "# HELP loragate_requests_in_flight Inference requests being answered now.",
            "# TYPE loragate_requests_in_flight gauge",
            f"loragate_requests_in_flight {self.in_flight}",
        ]
        return out


class RequestObserver:
    """Pure ASGI middleware: times inference requests and records them (and logs them)."""

    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics, access_log_enabled: bool = False
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log_enabled = access_log_enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # An outer observer (the app this one is mounted in) records the request, not this one.
        if scope["type"] != "http" or current_observation.get() is not None:
            await self.app(scope, receive, send)
            return
        route = observed_route(route_path(scope))
        if route is None:
            await self.app(scope, receive, send)
            return
        observation = RequestObservation(time.perf_counter())
        token = current_observation.set(observation)
        metrics = self.metrics

        async def observing_send(message: Message) -> None:
            note_sent(observation, message)
            await send(message)

        metrics.in_flight += 1
        try:
            await self.app(scope, receive, observing_send)
        except BaseException:
            if not observation.status:
                observation.status = 500
            raise
        finally:
            current_observation.reset(token)
            settle(metrics, route, observation, scope, self.access_log_enabled)


def note_sent(observation: RequestObservation, message: Message) -> None:
    """Stamp an ASGI send message on ``observation``: its status, first byte and end.

    Stamped as the bytes are handed to the server: what happens after (this task being
    preempted by the client it just woke) is not the request's time.
    """
    kind = message["type"]
    if kind == "http.response.start":
        observation.status = message["status"]
    elif kind == "http.response.body":
        now = time.perf_counter()
        if not observation.first_byte and message.get("body"):
            observation.first_byte = now
        if not message.get("more_body", False):
            observation.finished = now


def settle(
    metrics: GatewayMetrics,
    route: str,
    observation: RequestObservation,
    scope: Scope,
    access_log_enabled: bool,
) -> None:
    """The request is over: out of the in-flight count, recorded, and logged when asked."""
    metrics.in_flight -= 1
    ended = observation.finished or time.perf_counter()
    metrics.record(route, observation, ended)
    if access_log_enabled:
        log_access(scope, observation, ended)


def log_access(scope: Scope, observation: RequestObservation, ended: float) -> None:
    duration_ms = round((ended - observation.started) * 1000, 2)
    access_log.info(
        "%s %s %s model=%s request_id=%s trace_id=%s %.2f ms",
        scope["method"],
        scope["path"],
        observation.status,
        observation.model,
        observation.request_id,
        observation.trace_id or "-",
        duration_ms,
        extra={
            "request_id": observation.request_id,
            "trace_id": observation.trace_id,
            "model": observation.model,
            "status": observation.status,
            "duration_ms": duration_ms,
        },
    )


# ----- the scrape -----------------------------------------------------------------------------


async def render(gateway: Gateway) -> bytes:
    """The whole scrape: the gateway's metrics, its backend's state, then the engine's own."""
    lines = gateway.metrics.render()
    lines += _process_lines()
    backend: Any = gateway.backend
    supervisor = getattr(backend, "supervisor", None)
    if supervisor is not None:
        lines += _engine_lines(supervisor)
    manager = getattr(backend, "manager", None)
    if manager is not None:
        lines += await _adapter_lines(manager)
    engine_text = await _engine_metrics(supervisor)
    lines += [
        "# HELP loragate_engine_metrics_up Whether the engine's own /metrics answered this scrape.",
        "# TYPE loragate_engine_metrics_up gauge",
        f"loragate_engine_metrics_up {1 if engine_text else 0}",
    ]
    text = "\n".join(lines).encode() + b"\n" + gateway_process_metrics()
    if engine_text:
        text += relabel_engine_metrics(engine_text, getattr(backend, "rename_engine_ids", None))
    return text


def _process_lines() -> list[str]:
    import psutil

    process = psutil.Process()
    with process.oneshot():
        rss = process.memory_info().rss
        cpu = process.cpu_times()
    return [
        "# HELP loragate_process_resident_memory_bytes The gateway process's resident memory.",
        "# TYPE loragate_process_resident_memory_bytes gauge",
        f"loragate_process_resident_memory_bytes {rss}",
        "# HELP loragate_process_cpu_seconds_total CPU time the gateway process used.",
        "# TYPE loragate_process_cpu_seconds_total counter",
        f"loragate_process_cpu_seconds_total {_number(cpu.user + cpu.system)}",
    ]


def _engine_lines(supervisor: Any) -> list[str]:
    from loragate.supervisor.states import EngineState

    state = str(supervisor.state)
    out = [
        "# HELP loragate_engine_state The engine's life-cycle state (1 for the current one).",
        "# TYPE loragate_engine_state gauge",
    ]
    out += [f'loragate_engine_state{{state="{s}"}} {1 if s == state else 0}' for s in EngineState]
    out += [
        "# HELP loragate_engine_restarts_total Engine restarts since the gateway started.",
        "# TYPE loragate_engine_restarts_total counter",
        f"loragate_engine_restarts_total {supervisor.restarts}",
        "# HELP loragate_requests_queued Requests waiting for the engine to become ready.",
        "# TYPE loragate_requests_queued gauge",
        f"loragate_requests_queued {supervisor.waiting}",
    ]
    return out


_ADAPTER_COUNTERS = (
    ("loads", "loragate_adapter_loads_total", "Adapter versions loaded into the engine."),
    ("swaps", "loragate_adapter_swaps_total", "Hot swaps: a public name moved to a new version."),
    ("load_failures", "loragate_adapter_load_failures_total", "Adapter loads that failed."),
    (
        "unloads",
        "loragate_adapter_unloads_total",
        "Retired adapter versions unloaded after draining.",
    ),
    (
        "store_repairs",
        "loragate_adapter_store_repairs_total",
        "Live adapter versions found modified on disk and stored again from their source.",
    ),
)


async def _adapter_lines(manager: Any) -> list[str]:
    out: list[str] = []
    counters = manager.counters
    for key, name, help_text in _ADAPTER_COUNTERS:
        out += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} counter",
            f"{name} {counters.get(key, 0)}",
        ]
    last = manager.last_load_seconds
    out += [
        "# HELP loragate_adapter_last_load_duration_seconds How long the last adapter load took.",
        "# TYPE loragate_adapter_last_load_duration_seconds gauge",
        f"loragate_adapter_last_load_duration_seconds {_number(last) if last is not None else 'NaN'}",
        "# HELP loragate_adapters_served Public adapter names served now (the base model excluded).",
        "# TYPE loragate_adapters_served gauge",
        f"loragate_adapters_served {max(0, len(manager.public_models()) - 1)}",
    ]
    store = manager.store
    try:
        size = await asyncio.to_thread(store.total_bytes)  # reads every version's metadata
    except OSError as exc:
        log.warning("metrics: could not size the adapter store: %s", exc)
        size = None
    out += [
        "# HELP loragate_adapter_store_bytes Bytes the adapter store holds on disk.",
        "# TYPE loragate_adapter_store_bytes gauge",
        f"loragate_adapter_store_bytes {size if size is not None else 'NaN'}",
        "# HELP loragate_adapter_store_evictions_total Adapter versions evicted to keep the store under its cap.",
        "# TYPE loragate_adapter_store_evictions_total counter",
        f"loragate_adapter_store_evictions_total {store.evictions}",
    ]
    return out


async def _engine_metrics(supervisor: Any) -> bytes | None:
    """The engine's own /metrics text, or None when there is no engine or it does not answer."""
    endpoint = getattr(supervisor, "endpoint", None) if supervisor is not None else None
    if endpoint is None or not supervisor.serving:
        return None
    try:
        answer = await plain_http.request(
            "GET",
            endpoint.base_url + "/metrics",
            timeout=3.0,
            headers=endpoint.headers,
            uds=getattr(endpoint, "uds", None),
        )
    except Exception as exc:  # a scrape must answer even when the engine does not
        log.debug("metrics: the engine's /metrics did not answer: %r", exc)
        return None
    return answer.body if answer.status == 200 else None


def _number(value: float) -> str:
    """A sample value or ``le`` bound the way prometheus_client writes it (``1.0``, ``NaN``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
