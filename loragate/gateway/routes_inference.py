"""OpenAI-compatible inference routes: thin handlers that parse, call the backend, answer.

The two POST routes are the hot path, so they skip the framework's per-request machinery:
they are plain Starlette routes (FastAPI's dependency solving and exit stacks would cost
about a fifth of the gateway's time for nothing, as they take the raw request anyway), and
``InferenceFastPath`` answers them ahead of the router, so route matching, the exception
middleware and the exit-stack middleware are skipped too. The routes stay registered for
the OpenAPI description and for apps that mount this router without the fast path. Errors
keep their OpenAI shape either way.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from loragate.gateway.errors import OpenAIError
from loragate.gateway.metrics import current_observation, route_path
from loragate.gateway.request_body import read_json_object
from loragate.gateway.runtime import Gateway

router = APIRouter()

# Request ids must be unique, not secret: a PRNG seeded from the OS is enough, and, unlike
# uuid4(), costs no system call per request.
_ids = random.Random()


def _request_id(request: Request) -> str:
    """The client's X-Request-ID when it is sane, else a new one."""
    for name, value in request.scope["headers"]:  # names arrive lower-cased (ASGI)
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if given and len(given) <= 128 and given.isprintable():
                return given
            break
    return f"{_ids.getrandbits(128):032x}"


def _target_model(gateway: Gateway, payload: dict[str, Any]) -> str:
    model = payload.get("model")
    valid = gateway.backend.model_ids()
    if model is None:
        return valid[0]
    if not isinstance(model, str):
        raise OpenAIError(400, "'model' must be a string", param="model", code="invalid_type")
    if model not in valid:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist. Valid models: {', '.join(valid)}",
            code="model_not_found",
            param="model",
        )
    return model


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.keys.check_inference(request)
    ids = gateway.backend.model_ids()
    created = int(gateway.started_at)
    data = [
        {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "loragate",
            "parent": None if index == 0 else ids[0],
        }
        for index, model in enumerate(ids)
    ]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


async def _accept(request: Request) -> tuple[Gateway, str, dict[str, Any]]:
    """The gateway, the request id (recorded for the metrics) and the authorized JSON body."""
    gateway: Gateway = request.app.state.gateway
    request_id = _request_id(request)
    observation = current_observation.get()
    if observation is not None:
        observation.request_id = request_id
    gateway.keys.check_inference(request)
    payload = await read_json_object(request, gateway.settings.max_body_bytes)
    return gateway, request_id, payload


async def chat_completions(request: Request) -> Response:
    gateway, request_id, payload = await _accept(request)
    payload = await gateway.chat_request(payload)
    return await _forward(gateway, "/v1/chat/completions", payload, request_id)


async def completions(request: Request) -> Response:
    gateway, request_id, payload = await _accept(request)
    gateway.check_generation_limits(payload)
    return await _forward(gateway, "/v1/completions", payload, request_id)


async def _forward(
    gateway: Gateway, path: str, payload: dict[str, Any], request_id: str
) -> Response:
    model = _target_model(gateway, payload)
    stream = payload.get("stream") is True
    observation = current_observation.get()
    if observation is not None:
        observation.model = model
        observation.stream = stream
    return await gateway.backend.forward(path, payload, model, stream, request_id)


Endpoint = Callable[[Request], Awaitable[Response]]

HOT_ROUTES: dict[str, Endpoint] = {
    "/v1/chat/completions": chat_completions,
    "/v1/completions": completions,
}
for _path, _endpoint in HOT_ROUTES.items():
    router.add_route(_path, _endpoint, methods=["POST"])


class InferenceFastPath:
    """Pure ASGI middleware: answers POST on ``HOT_ROUTES`` itself, everything else goes on.

    It sits inside the user middleware (security headers, CORS, metrics still apply) and
    outside the router. OpenAI errors become their responses here, as the app's handler
    would make them; anything else propagates to the server-error middleware as before.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = HOT_ROUTES.get(route_path(scope))
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await endpoint(Request(scope, receive, send))
        except OpenAIError as exc:
            response = exc.response()
        await response(scope, receive, send)
