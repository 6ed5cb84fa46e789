"""The inference POSTs, answered on the server's own connections without the ASGI machinery.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are what every client waits on, and
on them ASGI costs more than the gateway's own work: a scope and message dicts, a Starlette
request, three middleware wrappers, header validation per response header, and two socket
writes per answer. Here the endpoint gets the parsed headers and the body, and a complete
answer leaves in one write, head and body together, before any bookkeeping (metrics, access
log) is done. A stream is relayed chunk by chunk straight from the engine connection's
callback, held while the client's socket is full.

Only with CORS off (CORS headers come from the ASGI middleware; ``serve`` decides); every
other route, and any other ASGI server, goes through the app, which answers the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from loragate.gateway.access.security_headers import SECURITY_HEADERS
from loragate.gateway.errors import OpenAIError, nested_too_deeply
from loragate.gateway.observe.metrics import (
    RequestObservation,
    current_observation,
    note_sent,
    settle,
)
from loragate.gateway.proxy import RelayResponse
from loragate.gateway.requests.body import (
    check_declared_length,
    check_json_content_type,
    parse_json_object,
    too_large,
)
from loragate.gateway.routes import inference
from loragate.gateway.runtime import Gateway
from loragate.gateway.server.exchange import ClientGone, Exchange

log = logging.getLogger("loragate.gateway")


def endpoint_for(path: str) -> inference.Endpoint | None:
    return inference.HOT_ROUTES.get(path)


class HotRequest:
    """A hot request's headers, names lower-cased as the parser gives them (the first wins)."""

    __slots__ = ("headers",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        headers: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1")
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers


async def answer(gateway: Gateway, exchange: Exchange, endpoint: inference.Endpoint) -> None:
    """Answer one hot request on ``exchange``, recorded as the ASGI path records it."""
    route = exchange.scope["path"]
    metrics = gateway.metrics
    clock = time.perf_counter
    observation = RequestObservation(clock())
    token = current_observation.set(observation)
    metrics.in_flight += 1
    try:
        try:
            response = await _respond(gateway, exchange, endpoint)
        except OpenAIError as exc:
            response = exc.response()
        except RecursionError:  # a backend's own, the body's being capped at its parse
            response = nested_too_deeply().response()
        observation.status = response.status_code
        if isinstance(response, RelayResponse):
            await _relay(exchange, response, observation)
        elif type(response).__call__ is Response.__call__ and response.background is None:
            # Stamped before the write: the client it wakes may run before this task does.
            observation.first_byte = observation.finished = clock()
            exchange.write_whole(response.status_code, response.raw_headers, bytes(response.body))
        else:  # a custom backend's own response type: let it drive the ASGI cycle
            try:
                send = _observed_send(exchange, observation)
                await response(exchange.scope, exchange.receive, send)
            finally:
                # A stream cut short (the client left) ends now, not when collected.
                body = getattr(response, "body_iterator", None)
                close = getattr(body, "aclose", None)
                if close is not None:
                    with contextlib.suppress(Exception):
                        await close()
    except (ClientDisconnect, ClientGone):
        observation.status = 499  # nginx's "client closed request"
    except asyncio.CancelledError:
        observation.status = 499  # cancelled: the client left
        raise
    except Exception:
        log.exception("the gateway failed answering %s", route)
        observation.status = 500
        if not exchange.response_started:
            error = OpenAIError(500, "the gateway failed answering; see its log").response()
            exchange.write_whole(500, error.raw_headers, bytes(error.body))
        else:
            exchange.conn.transport.close()
    finally:
        current_observation.reset(token)
        settle(metrics, route, observation, exchange.scope, gateway.settings.access_log)


async def _respond(gateway: Gateway, exchange: Exchange, endpoint: inference.Endpoint) -> Response:
    request = HotRequest(exchange.scope["headers"])
    request_id = inference.admit(gateway, request)
    check_json_content_type(request.headers.get("content-type"))
    max_bytes = gateway.settings.max_body_bytes
    check_declared_length(request.headers.get("content-length"), max_bytes)
    payload = parse_json_object(await _read_body(exchange, max_bytes))
    return await endpoint(gateway, request_id, payload)


async def _read_body(exchange: Exchange, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await exchange.receive()  # 100-continue and flow control
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message["body"]
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message["more_body"]:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _relay(exchange: Exchange, response: RelayResponse, observation: Any) -> None:
    """Pass a stream on as it comes, chunked: the head at once (as the engine sent its own),
    then each chunk straight from the upstream connection's callback (``pipe``)."""
    conn = exchange.conn
    conn.relaying = response
    try:
        exchange.start_stream(response.raw_headers)
        if exchange.disconnected:
            return

        def write(chunk: bytes) -> None:
            if exchange.disconnected:
                return
            if not observation.first_byte:
                observation.first_byte = time.perf_counter()
            exchange.write_chunk(chunk)
            if conn.write_paused:
                response.hold()  # until the client catches up (resume_writing)

        await response.pipe(write)
        if exchange.disconnected:
            return
        observation.finished = time.perf_counter()
        exchange.end_stream()
    finally:
        if conn.relaying is response:
            conn.relaying = None
        response.close()


def _observed_send(exchange: Exchange, observation: RequestObservation) -> Any:
    async def send(message: Any) -> None:
        note_sent(observation, message)
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
        await exchange.send(message)

    return send
