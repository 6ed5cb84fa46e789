"""The engine's other OpenAI-compatible routes, passed through from an allow-list.

Every route in ``engine_allow_list.ENGINE_ROUTES`` gets a handler here, and nothing else reaches
the engine: its admin routes stay unreachable. Each request gets what the chat routes get:
the caller's key, the body limit, the media policy (every image in a JSON body, wherever it
sits, checked and sent on as a data URI: ``content_parts.check_forwarded_media``), a request
id, metrics and the access log, the W3C trace
headers, and the model renamed (public name in, engine id out; back again in the answer and
in every streamed event, which ``proxy`` does). A route the engine does not serve for its
model (vLLM answers a bare ``{"detail": "Not Found"}``) becomes an OpenAI-shaped error that
says why and what to do instead.

``GET /v1/models/{id}`` is answered here from the gateway's own list (vLLM has no such route).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlencode

import orjson
from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response

from loragate.gateway.access.engine_allow_list import ENGINE_ROUTES, EngineRoute
from loragate.gateway.backends.base import EngineCall, RelaysEngineCalls, ServesPresets
from loragate.gateway.errors import OpenAIError, model_not_found
from loragate.gateway.observe.metrics import current_observation
from loragate.gateway.requests.body import check_declared_length, read_json_object, too_large
from loragate.gateway.requests.content_parts import check_forwarded_media
from loragate.gateway.routes.inference import (
    admit,
    model_entry,
    target_model,
    unless_client_leaves,
)
from loragate.gateway.runtime import Gateway
from loragate.settings import Settings


# Checks on a Responses API request (``POST /v1/responses``) before it reaches the engine.
#
# The engine fetches any image URL it is given. Every forwarded body has its images checked by
# the gateway (``content_parts.check_forwarded_media``: --allowed-media-dir, private addresses refused,
# sizes capped) and sent on as data URIs, wherever they sit: ``input_image`` parts in input
# items, bare, or in a ``function_call_output``'s output. What the gateway cannot check is
# refused with a 400 that says what to send instead: images by ``file_id`` (no file store behind
# this gateway), ``input_file`` parts, media URLs in other parts, and ``mcp`` tools (the engine
# would connect to the ``server_url`` a client names).
def _bad(message: str, param: str, code: str = "unsupported_content_part") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


async def check_responses_request(payload: dict[str, Any], settings: Settings) -> None:
    """Check ``payload`` in place: images become checked data URIs; 4xx if bad. (The token
    cap is the gateway's, on every generation route: ``Gateway.cap_tokens``.)"""
    limit = payload.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise _bad(
            "'max_output_tokens' must be a positive integer", "max_output_tokens", "invalid_value"
        )
    _check_tools(payload.get("tools"))
    # Parts sit in input items' content, bare in input, and in a function_call_output's output.
    await check_forwarded_media(payload, settings)


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") == "mcp":
            raise _bad(
                f"tools[{index}] is an mcp tool: the engine would connect to the server it "
                "names, which this gateway does not allow. Use function tools.",
                f"tools[{index}]",
                "unsupported_tool",
            )


router = APIRouter()

_BARE_NOT_FOUND = (b'{"detail":"Not Found"}', b'{"detail": "Not Found"}')
_RESPONSE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,256}$")
# Query parameters GET /v1/responses/{id} takes (vLLM 0.32); others are dropped.
_RESPONSE_QUERY = ("stream", "starting_after")


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    admit(gateway, request)  # the same origin, host and key checks as the model list
    ids = gateway.backend.model_ids()
    if model_id not in ids:
        raise model_not_found(model_id, ids)
    entry = model_entry(gateway, model_id, ids)
    backend = gateway.backend
    preset = backend.model_preset(model_id) if isinstance(backend, ServesPresets) else None
    if preset is not None:  # the serving version's
        entry["preset"] = preset
    return Response(orjson.dumps(entry), media_type="application/json")


# ----- the three request shapes ---------------------------------------------------------------


async def _json_route(gateway: Gateway, route: EngineRoute, request: Request) -> Response:
    request_id = admit(gateway, request)
    payload = await read_json_object(request, gateway.settings.max_body_bytes)
    gateway.cap_tokens(route.path, payload)  # --max-tokens-cap, on the generation routes
    if route.path == "/v1/responses":
        await check_responses_request(payload, gateway.settings)
    else:  # messages, documents, queries: the engine would fetch their media URLs itself
        await check_forwarded_media(payload, gateway.settings)
    model = target_model(gateway, payload)
    stream = route.streams and payload.get("stream") is True
    _observe(model, stream)
    forwarding = gateway.backend.forward(route.path, payload, model, stream, request_id)
    return await unless_client_leaves(request.receive, forwarding)


async def _plain_route(gateway: Gateway, route: EngineRoute, request: Request) -> Response:
    request_id = admit(gateway, request)
    path = route.path
    response_id = request.path_params.get("response_id")
    if response_id is not None:
        if not _RESPONSE_ID.match(response_id) or response_id in (".", ".."):
            raise OpenAIError(404, f"No response has the id {response_id!r}.", code="not_found")
        path = path.replace("{id}", quote(response_id, safe=""))
    query = {k: request.query_params[k] for k in _RESPONSE_QUERY if k in request.query_params}
    if query and response_id is not None:
        path += "?" + urlencode(query)
    stream = route.streams and query.get("stream") == "true"
    _observe(None, stream)
    call = EngineCall(request.method, path, _no_body, None, None, stream, request_id)
    return await unless_client_leaves(request.receive, _relaying(gateway, route).relay(call))


async def _upload_route(gateway: Gateway, route: EngineRoute, request: Request) -> Response:
    """A multipart upload (audio): read within the body limit, the model field renamed."""
    request_id = admit(gateway, request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "multipart/form-data":
        raise OpenAIError(
            415,
            f"Send {route.path} as multipart/form-data (a file upload), as OpenAI's API does.",
            code="unsupported_media_type",
        )
    max_bytes = gateway.settings.max_body_bytes
    check_declared_length(request.headers.get("content-length"), max_bytes)
    fields = await _form_fields(request, max_bytes)
    given = next((v for k, v in fields if k == "model" and isinstance(v, str)), None)
    model = target_model(gateway, {"model": given} if given is not None else {})
    stream = any(k == "stream" and v == "true" for k, v in fields)
    _observe(model, stream)
    boundary = "loragate-" + secrets.token_hex(12)

    def body(engine_id: str | None) -> bytes:
        renamed = [(k, v) for k, v in fields if k != "model"] + [("model", engine_id or model)]
        return _multipart(renamed, boundary)

    call = EngineCall(
        "POST",
        route.path,
        body,
        f"multipart/form-data; boundary={boundary}",
        model,
        stream,
        request_id,
    )
    return await unless_client_leaves(request.receive, _relaying(gateway, route).relay(call))


# ----- the pieces -----------------------------------------------------------------------------

FormValue = str | tuple[str, str, bytes]  # text, or (filename, content type, content)


async def _form_fields(request: Request, max_bytes: int) -> list[tuple[str, FormValue]]:
    size = 0
    chunks: list[bytes] = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)

    async def replay() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        form = await Request(request.scope, replay).form()
    except Exception as exc:  # python-multipart's errors, or a missing boundary
        raise OpenAIError(
            400, f"The upload is not valid multipart/form-data: {exc}", code="invalid_request"
        ) from None
    fields: list[tuple[str, FormValue]] = []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            content = await value.read()
            kind = value.content_type or "application/octet-stream"
            fields.append((name, (value.filename or "upload", kind, content)))
        else:
            fields.append((name, value))
    await form.close()
    return fields


def _multipart(fields: list[tuple[str, FormValue]], boundary: str) -> bytes:
    out: list[bytes] = []
    for name, value in fields:
        out.append(f"--{boundary}\r\n".encode())
        disposition = f'Content-Disposition: form-data; name="{_quoted(name)}"'
        if isinstance(value, str):
            out.append(f"{disposition}\r\n\r\n".encode())
            out.append(value.encode())
        else:
            filename, kind, content = value
            out.append(
                f'{disposition}; filename="{_quoted(filename)}"\r\nContent-Type: {kind}\r\n\r\n'.encode()
            )
            out.append(content)
        out.append(b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out)


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', "%22").replace("\r", "").replace("\n", "")


def _no_body(_engine_id: str | None) -> bytes:
    return b""


def _observe(model: str | None, stream: bool) -> None:
    observation = current_observation.get()
    if observation is not None:
        observation.model = model
        observation.stream = stream


def _relaying(gateway: Gateway, route: EngineRoute) -> RelaysEngineCalls:
    backend = gateway.backend
    if not isinstance(backend, RelaysEngineCalls):
        raise OpenAIError(
            404,
            f"This gateway's backend does not serve {route.path}.",
            code="not_supported",
        )
    return backend


def explain_unserved(response: Response, route: EngineRoute, path: str) -> Response:
    """The engine's bare "Not Found" for a route it lacks, as an error that says why."""
    if response.status_code not in (404, 405, 501):
        return response
    body = bytes(getattr(response, "body", b"") or b"")
    store_off = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") not in ("1", "true", "True")
    if body.strip() in _BARE_NOT_FOUND or response.status_code == 501:
        hint = route.hint(path) or f"This gateway's engine does not serve {path}."
    elif route.path.startswith("/v1/responses/{id}") and store_off:
        hint = _error_message(body) + " " + (route.hint(path) or "")
    else:
        return response
    headers = {"X-Request-ID": response.headers.get("x-request-id", "")}
    return OpenAIError(
        404, hint.strip(), code="route_not_served", headers={k: v for k, v in headers.items() if v}
    ).response()


def _error_message(body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error", {})
        return str(error.get("message", "")).strip()
    except (orjson.JSONDecodeError, AttributeError):
        return ""


# ----- registration ---------------------------------------------------------------------------

_SHAPES: dict[str, Callable[[Gateway, EngineRoute, Request], Awaitable[Response]]] = {
    "json": _json_route,
    "plain": _plain_route,
    "multipart": _upload_route,
}


def _handler(route: EngineRoute) -> Callable[[Request], Awaitable[Response]]:
    answer = _SHAPES[route.shape]

    async def handle(request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        response = await answer(gateway, route, request)
        return explain_unserved(response, route, request.url.path)

    handle.__name__ = "engine" + re.sub(r"\W+", "_", route.path)
    return handle


for _route in ENGINE_ROUTES:
    router.add_route(
        _route.path.replace("{id}", "{response_id}"), _handler(_route), methods=[_route.method]
    )
