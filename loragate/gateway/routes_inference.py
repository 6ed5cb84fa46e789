"""OpenAI-compatible inference routes: thin handlers that parse, call the backend, answer."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from loragate.gateway.errors import OpenAIError
from loragate.gateway.request_body import read_json_object
from loragate.gateway.runtime import Gateway

router = APIRouter()


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given and len(given) <= 128 and given.isprintable():
        return given
    return uuid.uuid4().hex


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


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.keys.check_inference(request)
    payload = await read_json_object(request, gateway.settings.max_body_bytes)
    payload = await gateway.chat_request(payload)
    model = _target_model(gateway, payload)
    stream = payload.get("stream") is True
    return await gateway.backend.forward(
        "/v1/chat/completions", payload, model, stream, _request_id(request)
    )


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.keys.check_inference(request)
    payload = await read_json_object(request, gateway.settings.max_body_bytes)
    gateway.check_generation_limits(payload)
    model = _target_model(gateway, payload)
    stream = payload.get("stream") is True
    return await gateway.backend.forward("/v1/completions", payload, model, stream, _request_id(request))
