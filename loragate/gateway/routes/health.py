"""Health routes: readiness (engine and adapters) and liveness (this process)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from loragate.gateway.runtime import Gateway
from loragate.logs import loggable_in

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    ready, body = gateway.backend.health()
    # Its reason may quote the engine's output: its secrets or a terminal escape.
    return Response(
        orjson.dumps(loggable_in(body)),
        status_code=200 if ready else 503,
        media_type="application/json",
        headers={} if ready else {"Retry-After": "5"},
    )


@router.get("/health/live")
async def live() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")
