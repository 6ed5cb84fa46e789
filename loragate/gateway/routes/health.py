"""Health routes: readiness (engine and adapters) and liveness (this process).

Readiness answers on ``/health`` and, as the Vi SDK's local server does, on ``/v1/health``
(``vi/deployment/local/server.py``: ``health_check_v1``); ready, its ``status`` is Vi's word,
``"healthy"``, with the served ``models``. Unlike Vi's server, which answers 200 with
``"unhealthy"``, a gateway not ready answers 503 (``starting``, ``failed``) so that probes
and load balancers can read the status code alone.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from loragate.gateway.backends.base import ReportsStart, engine_snapshot_of
from loragate.gateway.runtime import Gateway
from loragate.logs import loggable_in

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")
async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    ready, body = gateway.backend.health()
    body = {**body, **_uptimes(gateway)}
    progress = _start_progress(gateway)
    if not ready and progress is not None:
        body = {**body, "progress": progress}
    # Its reason may quote the engine's output: its secrets or a terminal escape.
    return Response(
        orjson.dumps(loggable_in(body)),
        status_code=200 if ready else 503,
        media_type="application/json",
        headers={} if ready else {"Retry-After": "5"},
    )


def _uptimes(gateway: Gateway) -> dict[str, float | None]:
    """Seconds the gateway has run and, when it runs an engine, the engine has served (null
    while it does not). Public, as the state is: both are on ``/metrics`` anyway; the engine's
    memory and pid stay behind the admin key (``/admin/engine``)."""
    uptimes: dict[str, float | None] = {"uptime_s": round(time.time() - gateway.started_at, 1)}
    engine = engine_snapshot_of(gateway.backend)
    if engine is not None:
        uptimes["engine_uptime_s"] = None if engine.uptime_s is None else round(engine.uptime_s, 1)
    return uptimes


def _start_progress(gateway: Gateway) -> dict[str, Any] | None:
    """The start's progress record (stage, bytes, percent, rate, description) while the
    gateway downloads its base model, dequantizes a GGUF or boots the engine; only a
    backend that starts its own engine has one."""
    backend = gateway.backend
    return backend.start_report() if isinstance(backend, ReportsStart) else None


@router.get("/health/live")
async def live() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")
