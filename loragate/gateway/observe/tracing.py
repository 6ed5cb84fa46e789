"""W3C trace context: a client's ``traceparent`` / ``tracestate`` go on to the engine.

vLLM reads these headers when it runs with OpenTelemetry (``--otlp-traces-endpoint``), so
its spans join the client's trace; the gateway's access log, and every JSON log line written
while the request is served, carry the trace id too, to find one request in both logs. A malformed ``traceparent`` is dropped (the W3C rule: start a new
trace rather than pass on garbage), and ``tracestate`` only travels with a valid one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextvars import ContextVar

from loragate.gateway.observe import spans
from loragate.logs import request_ids

# version "00": 2-hex version, 32-hex trace id, 16-hex parent id, 2-hex flags; later versions
# may append fields after another dash.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_MAX_TRACESTATE = 512  # the W3C list limit is 32 members; this bounds what we pass on

current_trace: ContextVar[dict[str, str] | None] = ContextVar("loragate_trace", default=None)


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace headers to pass on from a request's (lower-cased) headers; {} for none."""
    parent = headers.get("traceparent")
    if parent is None:
        return {}
    parent = parent.strip()
    match = _TRACEPARENT.match(parent)
    if match is None or match.group(1) == "ff" or (match.group(1) == "00" and match.group(5)):
        return {}
    if set(match.group(2)) == {"0"} or set(match.group(3)) == {"0"}:
        return {}  # all-zero ids are invalid
    found = {"traceparent": parent}
    state = headers.get("tracestate")
    if state and len(state) <= _MAX_TRACESTATE and state.isprintable():
        found["tracestate"] = state.strip()
    return found


def start_trace(headers: Mapping[str, str], request_id: str) -> dict[str, str] | None:
    """The trace headers a request passes on to the engine (kept in ``current_trace``); and
    the log lines written while it is served carry its ids from now on (``request_ids``)."""
    trace = trace_headers_of(headers) if "traceparent" in headers else None
    ids = {"request_id": request_id}
    if spans.tracer is not None:
        # The gateway's own spans (``spans``): the request's root span is the client's
        # child, and its trace (a new one without a client's) is the request's.
        trace = spans.begin_request(trace)
    if trace:
        ids["trace_id"] = trace["traceparent"].split("-")[1]
    current_trace.set(trace)
    request_ids.set(ids)
    return trace


def outgoing_trace_headers() -> dict[str, str]:
    """The current request's trace headers, for a request to the engine ({} when none);
    with the gateway's spans on, the current span's (the engine's spans are its children)."""
    if spans.tracer is not None:
        return spans.outgoing_traceparent()
    return current_trace.get() or {}
