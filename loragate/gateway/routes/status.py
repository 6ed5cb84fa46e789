"""What the status page reads beyond the admin API: the log tail and the last minutes of traffic.

``GET /admin/logs`` and ``GET /admin/activity`` (the last requests, tokens/s and KV-cache
use) are admin routes (same checks as every other: origin, host, admin key): a request list
says who uses which model when, which ``/metrics`` does not.
``GET /metrics/recent`` shows what ``/metrics`` shows, as JSON over time, so it follows the
``/metrics`` rule: public unless ``metrics_public`` is off, then the admin key.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import StreamingResponse

from loragate.gateway.backends.base import (
    CatalogAdmin,
    GatewayBackend,
    engine_metrics_of,
    engine_snapshot_of,
)
from loragate.gateway.observe.log_tail import engine_lines, gateway_lines, merged
from loragate.gateway.runtime import Gateway
from loragate.logs import loggable_in
from loragate.serving.engine_metrics import kv_cache_usage

HEARTBEAT_SECONDS = 5.0
# A followed tail ends after this long and the page asks again: no stream outlives its use
# by long, and none holds a graceful shutdown for more than a moment past it.
FOLLOW_MAX_SECONDS = 300.0


def _admit_admin(request: Request) -> None:
    gateway: Gateway = request.app.state.gateway
    gateway.admit_admin(request, request.client.host if request.client else None)


admin_router = APIRouter(dependencies=[Depends(_admit_admin)])
router = APIRouter()


def _engine_log_path(gateway: Gateway) -> Path | None:
    engine = engine_snapshot_of(gateway.backend)
    return engine.log_file if engine is not None else None


# Out of the OpenAPI schema: a followed tail never ends by itself, which schema fuzzers
# (tests/*/test_fuzz*.py) would wait on; docs/operations.md "The status page" documents it.
@admin_router.get("/admin/logs", include_in_schema=False)
async def log_tail(
    request: Request,
    source: Literal["all", "gateway", "engine"] = "all",
    lines: int = Query(200, ge=0, le=2000),
    follow: bool = False,
) -> StreamingResponse:
    """The last ``lines`` lines of the gateway's and/or the engine's log, as JSON lines
    ``{"source", "line"}``; with ``follow``, new lines as they are written (and an empty
    ``{}`` every few seconds of quiet), for up to five minutes, then the stream ends."""
    gateway: Gateway = request.app.state.gateway
    engine_log = _engine_log_path(gateway)
    sources: dict[str, AsyncIterator[str]] = {}
    if source in ("all", "gateway"):
        sources["gateway"] = gateway_lines(lines, follow)
    if source in ("all", "engine") and engine_log is not None:
        sources["engine"] = engine_lines(engine_log, lines, follow)

    async def body() -> AsyncIterator[bytes]:
        if not follow:
            for name, iterator in sources.items():
                async for line in iterator:
                    yield _line(name, line)
            return
        async for item in merged(sources, HEARTBEAT_SECONDS, FOLLOW_MAX_SECONDS):
            yield b"{}\n" if item is None else _line(*item)

    return StreamingResponse(
        body(),
        media_type="application/x-ndjson",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@admin_router.get("/admin/activity")
async def activity(request: Request) -> dict[str, Any]:
    """The last inference requests, newest first (time, route, model, adapter version, status,
    tokens, latency), completion tokens a second over the last seconds, and the engine's
    KV-cache use (0 to 1) when its /metrics reports it (else null)."""
    gateway: Gateway = request.app.state.gateway
    engine_text = await engine_metrics_of(gateway.backend)
    return {
        "requests": loggable_in(list(reversed(gateway.metrics.activity))),
        "tokens_per_second": gateway.metrics.tokens_per_second(),
        "kv_cache_usage": kv_cache_usage(engine_text) if engine_text else None,
    }


def _line(source: str, line: str) -> bytes:
    return orjson.dumps({"source": source, "line": line}) + b"\n"


@router.get("/metrics/recent")
async def recent_traffic(
    request: Request,
    window: int = Query(300, ge=10, le=600),
    step: int = Query(5, ge=1, le=60),
) -> dict[str, Any]:
    """Requests per second, errors, latency and time to first token over the last ``window``
    seconds in points of ``step`` seconds; requests in flight and waiting for the engine."""
    gateway: Gateway = request.app.state.gateway
    if not gateway.settings.metrics_public:
        gateway.check_admin_key(request, request.client.host if request.client else None)
    return {
        "now": time.time(),
        "window": window,
        "step": step,
        "in_flight": gateway.metrics.in_flight,
        "queued": _queued(gateway.backend),
        "points": gateway.metrics.recent.series(window, step),
    }


def _queued(backend: GatewayBackend) -> int:
    """Requests waiting for an engine to serve: a catalog's, every model's engine together."""
    if isinstance(backend, CatalogAdmin):
        return sum(engine.waiting_requests for engine in backend.engine_snapshots().values())
    engine = engine_snapshot_of(backend)
    return engine.waiting_requests if engine is not None else 0
