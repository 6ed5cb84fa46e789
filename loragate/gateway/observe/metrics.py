"""Recording the gateway's request metrics (``metrics_scrape`` turns them into the scrape).

Recording a request is a few dict and list operations (no locks, no label-object lookups),
which keeps the hot path as cheap as the proxy itself; a scrape hands the record to
``prometheus_client`` as metric families. One ``RequestObservation`` rides along with each
inference request (in a context variable, so the route and the proxy can add to it): the
route names the public model, the proxy adds the time spent waiting on the upstream, the
adapter version that answered and the answer's token usage, and ``RequestObserver`` (a pure
ASGI middleware) records status, duration, time to first token, tokens and the gateway's own
share of the time when the answer is complete.

Tokens are counted from the answer's ``usage`` (what the engine billed, not a re-count). A
plain answer always has it; a stream has it only in a last chunk the client asks for with
``stream_options.include_usage``. So the gateway asks for it on every stream
(``ask_for_usage``) and, when the client had not, the proxy counts that chunk and drops it: a
client sees the stream it asked for, and every streamed token is counted.
"""

from __future__ import annotations

import logging
import re
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loragate.gateway.access.engine_allow_list import engine_route
from loragate.gateway.generation_routes import HOT_PATHS
from loragate.gateway.observe import spans
from loragate.gateway.observe.traffic import RecentTraffic
from loragate.logs import loggable

log = logging.getLogger("loragate.gateway")
access_log = logging.getLogger("loragate.access")

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
# Time per output token: vLLM's own buckets (vllm:time_per_output_token_seconds), up to 2.5 s.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
RECENT_REQUESTS = 50  # the status page's activity list
TOKEN_RATE_SECONDS = 10  # the status page's tokens/s: completion tokens over the last seconds


def observed_route(path: str) -> str | None:
    """The route label an inference or engine pass-through request is recorded under (the
    allow-list's template for paths with an id); None for the routes not recorded."""
    if path in HOT_PATHS:  # the gateway's own generation routes
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
        "completion_tokens",
        "finished",
        "first_byte",
        "model",
        "prompt_tokens",
        "request_id",
        "started",
        "status",
        "stream",
        "trace_id",
        "upstream_seconds",
        "usage_added",
        "version",
    )

    def __init__(self, started: float) -> None:
        self.started = started
        self.model: str | None = None
        self.request_id: str | None = None
        self.trace_id: str | None = None
        self.version: str | None = None  # the adapter version (digest prefix) that answered
        self.stream = False
        self.usage_added = False  # the gateway asked for the stream's usage chunk, not the client
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.status = 0
        self.first_byte = 0.0
        self.finished = 0.0
        self.upstream_seconds = 0.0

    def note_usage(self, data: bytes) -> int:
        """Take the token counts of the last ``usage`` object in ``data`` (an answer, or a
        stream's events); where that object starts in ``data``, or -1 when it has none."""
        at = data.rfind(b'"usage"')
        if at < 0:
            return -1
        opened = _USAGE_OPEN.match(data, at)
        if opened is None:  # "usage": null
            return -1
        counts = dict(_USAGE_COUNT.findall(data, opened.end(), opened.end() + 512))
        if b"prompt" not in counts and b"completion" not in counts:
            return -1
        self.prompt_tokens = int(counts.get(b"prompt", 0))
        self.completion_tokens = int(counts.get(b"completion", 0))
        return at


# "usage" with its closing quote can only be a key (inside a JSON string the quote would be
# escaped); the counts are its first members in vLLM's, OpenAI's and llama.cpp's order.
_USAGE_OPEN = re.compile(rb'"usage"\s*:\s*\{')
_USAGE_COUNT = re.compile(rb'"(prompt|completion)_tokens"\s*:\s*(\d+)')


def ask_for_usage(path: str, payload: dict[str, Any]) -> None:
    """Ask the upstream of a chat or legacy completion stream for its usage chunk when the
    client did not (the request's observation remembers, so the proxy drops that chunk).
    Continuous usage stats stay off unless the client asked for both: they would put usage
    in every chunk. Only for requests the proxy relays (it is the one that drops the chunk)."""
    observation = current_observation.get()
    if observation is None or path not in HOT_PATHS or payload.get("stream") is not True:
        return
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return
    asked = dict(options) if isinstance(options, dict) else {}
    asked["include_usage"] = True
    asked.pop("continuous_usage_stats", None)
    payload["stream_options"] = asked
    observation.usage_added = True


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

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, ``+Inf`` last (``HistogramMetricFamily``'s form)."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((floatToGoString(bound), running))
        out.append(("+Inf", self.count))
        return out


class GatewayMetrics:
    """The gateway's request metrics, recorded per request and rendered on scrape."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.duration: dict[tuple[str, str], Histogram] = {}
        self.ttft: dict[str, Histogram] = {}
        self.overhead = Histogram(OVERHEAD_BUCKETS)
        self.prompt_tokens: dict[str, int] = {}
        self.completion_tokens: dict[str, int] = {}
        self.tpot: dict[str, Histogram] = {}
        self.in_flight = 0
        self.recent = RecentTraffic()  # the last minutes, second by second (the status page)
        # The status page's activity list and tokens/s.
        self.activity: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self._token_seconds: deque[list[int]] = deque(maxlen=TOKEN_RATE_SECONDS + 1)

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
        if observation.prompt_tokens is not None and observation.completion_tokens is not None:
            self._count_tokens(model, observation, ended)
        self.activity.append(
            {
                "at": time.time(),
                "route": route,
                "model": model,
                "version": observation.version,
                "status": observation.status,
                "prompt_tokens": observation.prompt_tokens,
                "completion_tokens": observation.completion_tokens,
                "latency_s": round(elapsed, 4),
                "stream": observation.stream,
            }
        )

    def _count_tokens(self, model: str, observation: RequestObservation, ended: float) -> None:
        prompt, completion = observation.prompt_tokens or 0, observation.completion_tokens or 0
        self.prompt_tokens[model] = self.prompt_tokens.get(model, 0) + prompt
        self.completion_tokens[model] = self.completion_tokens.get(model, 0) + completion
        # Time per output token after the first, as vLLM defines it: streams only (a plain
        # answer's first token is not seen).
        if observation.stream and observation.first_byte and completion > 1:
            tpot = self.tpot.get(model)
            if tpot is None:
                tpot = self.tpot[model] = Histogram(TPOT_BUCKETS)
            tpot.observe(max(0.0, ended - observation.first_byte) / (completion - 1))
        second = int(time.time())
        seconds = self._token_seconds
        if seconds and seconds[-1][0] == second:
            seconds[-1][1] += completion
        else:
            seconds.append([second, completion])

    def tokens_per_second(self) -> float:
        """Completion tokens a second over the last ``TOKEN_RATE_SECONDS`` whole seconds."""
        since = int(time.time()) - TOKEN_RATE_SECONDS
        return round(sum(n for at, n in self._token_seconds if at >= since) / TOKEN_RATE_SECONDS, 2)


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
    if spans.tracer is not None:
        spans.end_request(route, observation)
    if access_log_enabled:
        log_access(scope, observation, ended)


def log_access(scope: Scope, observation: RequestObservation, ended: float) -> None:
    """One line per request. The path, model and ids are the client's: escaped here
    (``loggable``), so the line stays one line whatever formatter an embedding app uses."""
    duration_ms = round((ended - observation.started) * 1000, 2)
    model, request_id, trace_id, version = (
        None if value is None else loggable(value)
        for value in (
            observation.model,
            observation.request_id,
            observation.trace_id,
            observation.version,
        )
    )
    prompt, completion = observation.prompt_tokens, observation.completion_tokens
    access_log.info(
        "%s %s %s model=%s request_id=%s trace_id=%s version=%s tokens=%s+%s %.2f ms",
        loggable(scope["method"]),
        loggable(scope["path"]),
        observation.status,
        model,
        request_id,
        trace_id or "-",
        version or "-",
        "-" if prompt is None else prompt,
        "-" if completion is None else completion,
        duration_ms,
        extra={
            "request_id": request_id,
            "trace_id": trace_id,
            "model": model,
            "version": version,
            "status": observation.status,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "duration_ms": duration_ms,
        },
    )
