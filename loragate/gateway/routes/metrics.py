"""GET /metrics: Prometheus text, public unless ``metrics_public`` is off (then the admin key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from loragate.gateway import metrics_scrape
from loragate.gateway.runtime import Gateway

router = APIRouter()


@router.get("/metrics")
async def scrape(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    if not gateway.settings.metrics_public:
        gateway.check_admin_key(request, request.client.host if request.client else None)
    return Response(await metrics_scrape.render(gateway), media_type=metrics_scrape.CONTENT_TYPE)
