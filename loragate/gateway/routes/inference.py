"""OpenAI-compatible inference routes: thin handlers that parse, call the backend, answer.

The two POST routes are the hot path: the endpoints take the gateway, the request id and the
JSON body, nothing from a framework. They are reached two ways, no more: under ``gateway
serve``, straight from the gateway server's own connections (``server.hot_routes``); on any other ASGI server (or with CORS on), through the router as
plain Starlette routes (FastAPI's dependency solving would cost a fifth of the gateway's time
for nothing). Errors keep their OpenAI shape both ways. A client that leaves before its answer
cancels it both ways too (here: ``unless_client_leaves``), which stops the engine's generation.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive

from loragate.gateway.access.auth import HasHeaders
from loragate.gateway.backends.base import KnowsContextLength, ListsModels, ResolvesModels
from loragate.gateway.errors import OpenAIError, client_closed, model_not_found
from loragate.gateway.generation_routes import CHAT, COMPLETIONS, GENERATION_ROUTES, Route
from loragate.gateway.observe import spans
from loragate.gateway.observe.metrics import current_observation
from loragate.gateway.observe.tracing import start_trace
from loragate.gateway.requests.body import read_json_object
from loragate.gateway.runtime import Gateway

router = APIRouter()

# Request ids must be unique, not secret: a PRNG seeded from the OS is enough, and, unlike
# uuid4(), costs no system call per request.
_ids = random.Random()
# A client's id is written into the access log, log lines and trace attributes, and sent to
# the engine: one word of a plain alphabet, so it cannot pass for other text (a forged line).
_SAFE_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _request_id(headers: Mapping[str, str]) -> str:
    """The client's X-Request-ID when it is one word of ``_SAFE_ID``'s alphabet, else a new one."""
    given = headers.get("x-request-id")
    if given and _SAFE_ID.fullmatch(given):
        return given
    return f"{_ids.getrandbits(128):032x}"


def admit(gateway: Gateway, request: HasHeaders) -> str:
    """Check where the request comes from (``cross_site``) and the caller's key; the request
    id (recorded for the metrics and the access log). The W3C trace headers are kept for the
    request to the engine (``tracing``)."""
    request_id = _request_id(request.headers)
    trace = start_trace(request.headers, request_id)
    observation = current_observation.get()
    if observation is not None:
        observation.request_id = request_id
        if trace:
            observation.trace_id = trace["traceparent"].split("-")[1]
    with spans.step(spans.ADMIT):
        _check_source(gateway, request)
    return request_id


def _check_source(gateway: Gateway, request: HasHeaders) -> None:
    gateway.cross_site.check_origin(request.headers)
    if gateway.keys.inference_open:
        gateway.cross_site.check_keyless_host(request.headers)
    gateway.keys.check_inference(request)


def target_model(gateway: Gateway, payload: dict[str, Any]) -> str:
    model = payload.get("model")
    valid = gateway.backend.model_ids()
    if model is None:
        return valid[0]
    if not isinstance(model, str):
        raise OpenAIError(400, "'model' must be a string", param="model", code="invalid_type")
    if model not in valid:  # the base model's other names (a local directory's whole path)
        model = gateway.settings.served_model_aliases.get(model, model)
    if model not in valid and not _resolvable(gateway, model):
        raise model_not_found(model, valid)
    return model


def _resolvable(gateway: Gateway, model: str) -> bool:
    """Whether the backend can find an unregistered ``model`` in a place the operator
    configured (a catalog model's ``adapter_dir``)."""
    backend = gateway.backend
    return isinstance(backend, ResolvesModels) and bool(backend.resolves(model))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    _check_source(gateway, request)
    backend = gateway.backend
    if isinstance(backend, ListsModels):  # several bases: each adapter's parent, each residency
        entries = backend.model_entries()
        data = [{**model_entry(gateway, e["id"], [e["parent"] or e["id"]]), **e} for e in entries]
    else:
        ids = backend.model_ids()
        data = [model_entry(gateway, model, ids) for model in ids]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


def model_entry(gateway: Gateway, model: str, ids: list[str]) -> dict[str, Any]:
    """One ``/v1/models`` entry (``ids``: the public ids, base first), with the engine's
    ``max_model_len`` as vLLM's own entries carry it (clients size their context from it)
    when the backend knows it."""
    entry: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": int(gateway.started_at),
        "owned_by": "loragate",
        "parent": None if model == ids[0] else ids[0],
    }
    backend = gateway.backend
    max_model_len = backend.max_model_len() if isinstance(backend, KnowsContextLength) else None
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry


async def chat_completions(gateway: Gateway, request_id: str, payload: dict[str, Any]) -> Response:
    with spans.step(spans.CHECK):
        payload = await gateway.chat_request(payload)
    return await _forward(gateway, CHAT.path, payload, request_id)


async def completions(gateway: Gateway, request_id: str, payload: dict[str, Any]) -> Response:
    with spans.step(spans.CHECK):
        gateway.check_generation_limits(payload)
    return await _forward(gateway, COMPLETIONS.path, payload, request_id)


async def _forward(
    gateway: Gateway, path: str, payload: dict[str, Any], request_id: str
) -> Response:
    model = target_model(gateway, payload)
    stream = payload.get("stream") is True
    observation = current_observation.get()
    if observation is not None:
        observation.model = model
        observation.stream = stream
    with spans.upstream_step():
        response = await gateway.backend.forward(path, payload, model, stream, request_id)
    if response.status_code == 404:
        return _explain_pooling_engine(response, path)
    return response


_GENERATION_HINT = (
    "vLLM serves {path} only for a generation model; this gateway's engine runs a pooling "
    "model (an embedding, scoring or reward model: engine flag --runner pooling). Use "
    "/v1/embeddings, /pooling, /v1/score, /v1/rerank or /classify, or serve a generation model."
)
_BARE_NOT_FOUND = (b'{"detail":"Not Found"}', b'{"detail": "Not Found"}')


def _explain_pooling_engine(response: Response, path: str) -> Response:
    """The engine's bare "Not Found" for a generation route (it runs a pooling model), as an
    OpenAI-shaped error that says why and what to use."""
    if bytes(getattr(response, "body", b"") or b"").strip() not in _BARE_NOT_FOUND:
        return response
    request_id = response.headers.get("x-request-id")
    return OpenAIError(
        404,
        _GENERATION_HINT.format(path=path),
        code="route_not_served",
        headers={"X-Request-ID": request_id} if request_id else None,
    ).response()


Endpoint = Callable[[Gateway, str, dict[str, Any]], Awaitable[Response]]

_ENDPOINTS: dict[Route, Endpoint] = {"chat": chat_completions, "completions": completions}
# The hot routes (POST only), each generation route the gateway answers itself
# (``generation_routes``): through the router on any ASGI server, and without ASGI at all by
# ``server.hot_routes`` under ``gateway serve``.
HOT_ROUTES: dict[str, Endpoint] = {
    route.path: _ENDPOINTS[route.kind]
    for route in GENERATION_ROUTES
    if route.hot and route.kind is not None
}


def _asgi_route(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        request_id = admit(gateway, request)
        payload = await read_json_object(request, gateway.settings.max_body_bytes)
        return await unless_client_leaves(request.receive, endpoint(gateway, request_id, payload))

    route.__name__ = endpoint.__name__
    return route


async def unless_client_leaves(receive: Receive, answer: Awaitable[Response]) -> Response:
    """``answer``, cancelled if the client disconnects first (what the hot path's
    ``connection_lost`` does): the cancel cuts the engine connection, so the engine aborts the
    generation, and ends the adapter lease. Then a 499 nobody reads is what is returned (for
    the metrics and the access log). Once the body is read, ``receive`` gives nothing but
    ``http.disconnect``: when the client leaves, or after the response is sent."""
    work = asyncio.ensure_future(answer)
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        work.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not left or (task is not None and task.cancelling()):
            raise
        return client_closed().response()
    finally:
        watcher.cancel()


for _path, _endpoint in HOT_ROUTES.items():
    router.add_route(_path, _asgi_route(_endpoint), methods=["POST"])
