"""The engine's health probe: GET /health over its socket, and optionally a one-token
completion, which also catches an engine whose API answers while its core is stuck."""

from __future__ import annotations

import logging

from loragate.http import oneshot
from loragate.supervisor.engine_endpoint import EngineEndpoint

log = logging.getLogger("loragate.supervisor")


async def probe_engine(
    endpoint: EngineEndpoint | None, timeout: float, *, deep_model: str | None = None
) -> bool:
    """Whether the engine answers; ``deep_model`` names the model for the deep probe (None:
    /health only)."""
    if endpoint is None:
        return False
    try:
        response = await oneshot.request(
            "GET", f"{endpoint.base_url}/health", timeout=timeout, uds=endpoint.uds
        )
        if response.status != 200:
            return False
        if deep_model is not None:
            response = await oneshot.request(
                "POST",
                f"{endpoint.base_url}/v1/completions",
                timeout=timeout,
                uds=endpoint.uds,
                headers=endpoint.headers,
                json={"model": deep_model, "prompt": "ping", "max_tokens": 1},
            )
            return response.status == 200
        return True
    except oneshot.PlainHTTPError as exc:
        log.debug("health probe failed: %s", exc)
        return False
