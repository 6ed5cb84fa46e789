"""The inference POSTs, answered on uvicorn's own connections without the ASGI machinery.

``gateway serve`` runs uvicorn with ``hot_protocol(gateway)`` as its HTTP protocol: uvicorn's
httptools protocol, unchanged for every request but ``POST /v1/chat/completions`` and
``POST /v1/completions``. Those two are what every client waits on, and on them ASGI costs
more than the gateway's own work: a scope and message dicts, a Starlette request, three
middleware wrappers, header validation per response header, and two socket writes per answer
(head, then body), so the client wakes twice. Here the endpoint gets the parsed headers and
the body, and a complete answer leaves in one write, head and body together, before any
bookkeeping (metrics, access log) is done.

Everything HTTP stays uvicorn's: parsing, keep-alive and its timeout, pipelining, flow
control, ``Expect: 100-continue``, graceful shutdown; and ``connection_guard``'s, whose
protocol this one extends: deadlines, the header budget, requests counted against
``limit_concurrency``. This module only replaces the task started per admitted request
(``start_request``) for the hot routes, and drives the same ``RequestResponseCycle`` uvicorn
made for it. It is used only with CORS off (CORS headers come from the ASGI middleware);
every other route, and any ASGI server, goes through the app.

What it stands in for, it does as the uvicorn releases it was checked on do: the task per
request (``_start_asgi_task``: counted in the server's tasks, in a fresh context when
``--reset-contextvars`` asks for one), the answer (``RequestResponseCycle.send``: status
line, uvicorn's default headers, ``connection: close`` off keep-alive, no more waiting to
send ``100 Continue``, then the cycle completed and the next pipelined request started) and
the end of it (``run_asgi``: a 500 or a close on an error, the cycle's callback dropped). A
uvicorn whose copy of any of those differs from the ones it was checked on is one it
refuses (``uvicorn_fit.fast_path_unfit``, a fingerprint per piece): ``gateway serve`` then
serves every route through plain ASGI and says why in one log line.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from starlette.responses import Response

from loragate.gateway.connection_guard import SECURITY_LINES, GuardedProtocol
from loragate.gateway.errors import OpenAIError
from loragate.gateway.metrics import (
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
from loragate.gateway.security_headers import SECURITY_HEADERS
from loragate.gateway.uvicorn_fit import STATUS_LINE

if TYPE_CHECKING:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

log = logging.getLogger("loragate.gateway")

_STREAM_END = b"0\r\n\r\n"


class _ClientGone(Exception):
    """The client closed the connection before its request body arrived."""


class HotRequest:
    """A hot request's headers, names lower-cased as uvicorn gives them (the first one wins)."""

    __slots__ = ("headers",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        headers: dict[str, str] = {}
        for name, value in raw:
            key = name.decode("latin-1")
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers


def hot_protocol(gateway: Gateway) -> type[HotRouteProtocol]:
    """uvicorn's ``http`` protocol class for this gateway (pass it as ``uvicorn.run(http=...)``)."""
    return HotRouteProtocol.bound_to(gateway.settings, gateway=gateway)


class HotRouteProtocol(GuardedProtocol):
    gateway: Gateway
    _relaying: RelayResponse | None = None
    _answering: asyncio.Task[Any] | None = None  # the task of the request being answered

    def start_request(self, cycle: RequestResponseCycle, app: Any) -> None:
        scope = cycle.scope
        endpoint = None
        # `app is self.app`: past --limit-concurrency the guard swaps in its 503 app.
        if scope["method"] == "POST" and app is self.app:
            endpoint = inference.HOT_ROUTES.get(scope["path"])
        if endpoint is None:
            super().start_request(cycle, app)
            return
        answer = self._answer(cycle, scope["path"], endpoint)
        if self.config.reset_contextvars:  # as uvicorn's own task start does (0.53 on)
            task = self.loop.create_task(answer, context=contextvars.Context())
        else:
            task = self.loop.create_task(answer)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        relaying = self._relaying
        if relaying is not None:
            relaying.abort()  # the engine stops generating for a client that left
        elif self._answering is not None:
            # Nobody will read this answer: the task's engine connection is cut, so the
            # engine aborts the generation, and the adapter lease ends now, not at max_tokens.
            self._answering.cancel()
        super().connection_lost(exc)

    # ----- one request --------------------------------------------------------------------

    async def _answer(
        self, cycle: RequestResponseCycle, route: str, endpoint: inference.Endpoint
    ) -> None:
        gateway = self.gateway
        metrics = gateway.metrics
        clock = time.perf_counter
        observation = RequestObservation(clock())
        token = current_observation.set(observation)
        metrics.in_flight += 1
        self._answering = answering = asyncio.current_task()
        try:
            try:
                response = await self._respond(cycle, endpoint)
            except OpenAIError as exc:
                response = exc.response()
            observation.status = response.status_code
            if isinstance(response, RelayResponse):
                await self._relay(cycle, response, observation)
            elif type(response).__call__ is Response.__call__ and response.background is None:
                # Stamped before the write: the client it wakes may run before this task does.
                observation.first_byte = observation.finished = clock()
                body = bytes(response.body)
                self._write_whole(cycle, response.status_code, response.raw_headers, body)
            else:  # a custom backend's own response type: let it drive the ASGI cycle
                scope = cast(dict[str, Any], cycle.scope)
                await response(scope, cast(Any, cycle.receive), _observed_send(cycle, observation))
        except _ClientGone:
            observation.status = 499  # nginx's "client closed request"
        except asyncio.CancelledError:
            observation.status = 499  # cancelled by connection_lost: the client left
            raise
        except Exception:
            log.exception("the gateway failed answering %s", route)
            observation.status = 500
            if not cycle.response_started and not cycle.disconnected:
                error = OpenAIError(500, "the gateway failed answering; see its log").response()
                self._write_whole(cycle, 500, error.raw_headers, bytes(error.body))
            else:
                cycle.transport.close()
        finally:
            if self._answering is answering:  # not yet the next pipelined request's
                self._answering = None
            cycle.on_response = _nothing  # as run_asgi: a finished cycle starts nothing more
            current_observation.reset(token)
            scope = cast(dict[str, Any], cycle.scope)
            settle(metrics, route, observation, scope, gateway.settings.access_log)

    async def _respond(self, cycle: RequestResponseCycle, endpoint: inference.Endpoint) -> Response:
        gateway = self.gateway
        request = HotRequest(cycle.scope["headers"])
        request_id = inference.admit(gateway, request)
        check_json_content_type(request.headers.get("content-type"))
        max_bytes = gateway.settings.max_body_bytes
        check_declared_length(request.headers.get("content-length"), max_bytes)
        payload = parse_json_object(await _read_body(cycle, max_bytes))
        return await endpoint(gateway, request_id, payload)

    # ----- writing answers ----------------------------------------------------------------

    def _head(
        self, cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]]
    ) -> list[bytes]:
        parts = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:  # uvicorn's date and server headers
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(SECURITY_LINES)
        if not cycle.keep_alive:
            parts.append(b"connection: close\r\n")
        return parts

    def _write_whole(
        self,
        cycle: RequestResponseCycle,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """Head and body in one write: the client wakes once, to a complete answer."""
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        if cycle.disconnected:
            return
        parts = self._head(cycle, status, headers)
        parts += (b"\r\n", body)
        cycle.transport.write(b"".join(parts))
        _complete(cycle)

    async def _relay(
        self, cycle: RequestResponseCycle, response: RelayResponse, observation: Any
    ) -> None:
        """Pass a stream on as it comes, chunked: the head at once (as the engine sent its own),
        then each chunk straight from the upstream connection's callback (``pipe``)."""
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        transport, flow = cycle.transport, cycle.flow
        self._relaying = response
        try:
            if cycle.disconnected:
                return
            parts = self._head(cycle, 200, response.raw_headers)
            parts.append(b"transfer-encoding: chunked\r\n\r\n")
            transport.write(b"".join(parts))

            def write(chunk: bytes) -> None:
                if cycle.disconnected:
                    return
                if not observation.first_byte:
                    observation.first_byte = time.perf_counter()
                transport.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                if flow.write_paused:
                    response.hold()  # until the client catches up (resume_writing)

            await response.pipe(write)
            if cycle.disconnected:
                return
            observation.finished = time.perf_counter()
            transport.write(_STREAM_END)
            _complete(cycle)
        finally:
            self._relaying = None
            response.close()

    def resume_writing(self) -> None:
        super().resume_writing()
        relaying = self._relaying
        if relaying is not None:
            relaying.release()


def _nothing() -> None:
    pass


def _complete(cycle: RequestResponseCycle) -> None:
    """What uvicorn does once a response is sent: close or arm keep-alive, start the next."""
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()


async def _read_body(cycle: RequestResponseCycle, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Any = await cycle.receive()  # handles 100-continue and flow control
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message["body"]
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message["more_body"]:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _observed_send(cycle: RequestResponseCycle, observation: RequestObservation) -> Any:
    async def send(message: Any) -> None:
        note_sent(observation, message)
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
        await cycle.send(message)

    return send
