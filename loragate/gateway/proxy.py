"""Forwarding requests to an OpenAI-compatible upstream over pooled keep-alive connections.

The body goes out as bytes; the answer comes back as bytes. The only rewrite is the
``model`` field (engine id -> the public name the client asked for), done on raw bytes, event
by event for streams, so nothing is buffered beyond one server-sent event. On the way, the
answer's token ``usage`` is noted for the metrics (``RequestObservation.note_usage``), and a
stream's usage chunk that the gateway asked for and the client did not is dropped.

Events end where the SSE spec says, at a blank line whatever the line ends (CRLF, LF or CR:
sse-starlette writes CRLF), and the client gets the upstream's bytes as they were, cut only
between events. What the gateway holds whole is capped (``max_answer_bytes``): a non-streamed
answer past it is a 502, and a stream event past it ends the stream with an error event in
its place (never half an event), the upstream connection cut. A non-streamed answer must
also arrive whole within ``silence_limit`` of the request, however steadily it trickles.

Why not httpx: on this path it cost about 0.3 ms of CPU per request (request and response
objects, header models, anyio, httpcore's pool) - most of what the gateway added on top of
the engine. The upstream is one known HTTP/1.1 server, usually on loopback, so
``loragate.http``'s pool of asyncio connections with httptools' C parser does the same job
for a tenth of that.

Nobody's work runs on after they leave: a request whose client goes away (its task is
cancelled, or a stream is aborted) has its engine connection cut, never pooled half-read,
which is how vLLM learns to abort the generation, and its lease (``on_done``) ends at once.
An engine that sends nothing for ``silence_limit`` seconds is given up on the same way, with
a 504 for the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loragate.gateway.backends.base import EngineCall
from loragate.gateway.errors import OpenAIError, error_event
from loragate.gateway.observe.metrics import current_observation
from loragate.gateway.observe.tracing import outgoing_trace_headers
from loragate.http.connection import (
    UpstreamBroken,
    UpstreamConnection,
    UpstreamOverdue,
    UpstreamSilent,
    UpstreamTooLarge,
)
from loragate.http.pool import Pool, Unreachable
from loragate.http.sse import EventSplitter, event_around
from loragate.http.wire import Origin, request_bytes, target
from loragate.serving.engine_names import Rename
from loragate.settings.request_limits import MAX_ANSWER_BYTES


# When a request the engine never answered may be sent to it again.
class ResendBudget:
    """Resend while the request's deadline lasts; a request that may itself have reached the
    engine just before it died only once, so a request that kills the engine cannot keep it in
    a crash loop (it costs at most one more restart, then its client gets the 503)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self._resent_maybe_delivered = False

    def allows(self, failure: UpstreamUnreachable) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        if failure.maybe_delivered:
            if self._resent_maybe_delivered:
                return False
            self._resent_maybe_delivered = True
        return True


class UpstreamUnreachable(OpenAIError):
    """Nothing listens upstream any more: the request is safe to send again once it is back.

    ``maybe_delivered`` marks the one case where an earlier copy of the request may have
    reached the upstream before it died (a kept-alive connection broke under it): that copy
    may be what killed it, so a caller resends such a request at most once.
    """

    maybe_delivered = False


# ----- the client the backends use ------------------------------------------------------------


class ProxyClient:
    """POSTs OpenAI requests upstream and turns the answers into ASGI responses."""

    def __init__(
        self,
        connect_timeout: float = 10.0,
        idle_timeout: float = 4.0,
        max_idle: int = 256,
        silence_limit: float | None = None,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        """``silence_limit``: seconds the upstream may send nothing of an answer (its head, or
        the next bytes of its body) before it is given up on, and in which a non-streamed
        answer must arrive whole; None for no limit. ``max_answer_bytes``: the most held
        whole, a non-streamed answer or one event of a stream."""
        self._pool = Pool(connect_timeout, idle_timeout, max_idle, silence_limit)
        self.max_answer_bytes = max_answer_bytes

    async def aclose(self) -> None:
        self._pool.close()

    async def relay(
        self,
        call: EngineCall,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        rename: Rename | None,
        on_done: Callable[[], None] = lambda: None,
        uds: str | None = None,
    ) -> Response:
        """Send ``call`` to ``url`` with ``body`` and the backend's ``headers`` (its key): what
        every backend sends for each request, from the call itself (method, streaming, request
        id and content type) and the trace context, once."""
        sent = {**headers, "X-Request-Id": call.request_id, **outgoing_trace_headers()}
        if call.content_type is not None:
            sent["Content-Type"] = call.content_type
        return await self.forward(
            url,
            body,
            sent,
            stream=call.stream,
            rename=rename,
            on_done=on_done,
            response_headers={"X-Request-ID": call.request_id},
            uds=uds,
            method=call.method,
        )

    async def forward(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        stream: bool,
        rename: Rename | None,
        on_done: Callable[[], None],
        response_headers: dict[str, str] | None = None,
        uds: str | None = None,
        method: str = "POST",
    ) -> Response:
        """POST ``body`` to ``url``; ``on_done`` runs exactly once, when the answer is complete
        or abandoned (an error, or the caller cancelled because its client left).

        With ``uds``, connect to that Unix socket instead of the URL's host and port; with
        ``method``, send that instead of POST (the engine's GET routes).
        """
        extra = response_headers or {}
        observation = current_observation.get()
        if observation is not None and rename is not None:
            # The adapter version that answers: an engine id is NAME@VERSION (engine_names).
            observation.version = rename.internal.partition(b"@")[2].decode() or None
        started = time.perf_counter()
        try:
            where = target(url, method, uds)
            conn = await self._pool.exchange(where, request_bytes(where, headers, body))
        except BaseException as exc:
            on_done()  # no answer to wait for (the pool cut the connection if it had one)
            if isinstance(exc, Unreachable):
                raise _unreachable(exc, extra) from exc
            if isinstance(exc, UpstreamSilent):
                raise _silent(exc, extra) from exc
            if isinstance(exc, (UpstreamBroken, OSError, TimeoutError, ValueError)):
                raise OpenAIError(
                    503,
                    f"the engine did not answer ({type(exc).__name__}); retry shortly",
                    code="engine_unavailable",
                    headers={"Retry-After": "5", **extra},
                ) from exc
            raise  # cancelled: the client went away
        if not stream or conn.status != 200:
            try:
                content = await conn.read_all(self.max_answer_bytes, self._pool.silence_limit)
            except UpstreamTooLarge as exc:
                raise OpenAIError(
                    502,
                    f"the engine's answer is larger than {exc.limit} bytes (--max-answer-bytes); "
                    "the request was abandoned",
                    code="engine_answer_too_large",
                    headers=extra,
                ) from exc
            except UpstreamSilent as exc:
                raise _silent(exc, extra) from exc
            except UpstreamBroken as exc:
                raise OpenAIError(
                    503,
                    "the engine stopped while answering; retry",
                    code="engine_unavailable",
                    headers={"Retry-After": "5", **extra},
                ) from exc
            finally:
                # Cut unless read whole (cancelled midway: the engine stops generating).
                self._pool.give_back(where.origin, conn)
                on_done()
            if observation is not None:
                observation.upstream_seconds += time.perf_counter() - started
                if conn.status == 200:
                    observation.note_usage(content)
            if rename is not None:
                content = (
                    rename.model_field(content) if conn.status < 400 else rename.everywhere(content)
                )
            return _Answer(content, conn.status, conn.content_type, extra)
        return RelayResponse(
            self._pool, where.origin, conn, rename, on_done, started,
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **extra},
            max_event_bytes=self.max_answer_bytes,
        )  # fmt: skip


def _silent(cause: UpstreamSilent, extra: dict[str, str]) -> OpenAIError:
    return OpenAIError(
        504,
        f"{_late(cause)} (--upstream-timeout); the request was abandoned",
        code="engine_timeout",
        headers=extra,
    )


def _late(cause: UpstreamSilent) -> str:
    if isinstance(cause, UpstreamOverdue):
        return f"the engine's answer had not arrived whole after {cause.seconds:g} s"
    return f"the engine sent nothing for {cause.seconds:g} s"


def _unreachable(cause: Unreachable, extra: dict[str, str]) -> UpstreamUnreachable:
    detail = f" ({cause.detail})" if cause.detail else ""
    unreachable = UpstreamUnreachable(
        503,
        f"the engine is not reachable{detail}; retry shortly",
        code="engine_unavailable",
        headers={"Retry-After": "5", **extra},
    )
    unreachable.maybe_delivered = cause.maybe_delivered
    return unreachable


class _Answer(Response):
    """A complete upstream answer, its headers written directly: status, type and length
    pass through as they came, and nothing is parsed again on the way out."""

    def __init__(
        self, body: bytes, status: int, content_type: bytes, extra: dict[str, str]
    ) -> None:
        self.body = body
        self.status_code = status
        self.background = None
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", content_type)]
        self.raw_headers += [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()
        ]


class RelayResponse(Response):
    """A server-sent event stream relayed chunk by chunk from an upstream connection.

    This is the relay's transport-neutral interface, driven two ways:

    - ``server.hot_routes`` drives it on the gateway server's connections without ASGI: ``pipe(write)`` passes
      the whole stream to the connection's ``write``, ``hold`` and ``release`` pause and resume
      the upstream while the client's socket is full (flow control), ``abort`` cuts the
      upstream when the client leaves and ``close`` gives the connection back;
    - any ASGI server drives it through ``__call__``, which sends what ``read`` returns.

    Lighter than Starlette's StreamingResponse (no task group per request): under ASGI one
    small task watches for the client going away and cuts the upstream connection, which
    makes the engine abort the generation.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        pool: Pool,
        origin: Origin,
        conn: UpstreamConnection,
        rename: Rename | None,
        on_done: Callable[[], None],
        started: float,
        headers: dict[str, str],
        max_event_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._pool = pool
        self._origin = origin
        self._conn = conn
        self._rename = rename
        self._on_done: Callable[[], None] | None = on_done
        self._started = started
        self._ended = False
        self._observation = current_observation.get()
        # Whole events are passed on when they are rewritten (renamed) or read (for usage).
        self._events = (
            EventSplitter(max_event_bytes)
            if rename is not None or self._observation is not None
            else None
        )
        self._too_large: UpstreamTooLarge | None = None  # an event past max_event_bytes

    async def read(self) -> bytes | None:
        """The next bytes to pass on (whole events when renaming); None after the last.

        If the upstream breaks midway, the last bytes are an OpenAI-shaped error event.
        """
        if self._ended:
            return None
        try:
            while True:
                chunk = await self._conn.next_chunk()
                if chunk is None:
                    self._end()
                    return self._tail() or None
                chunk = self._renamed(chunk)
                if chunk:
                    return chunk
        except UpstreamBroken as exc:
            self._end()
            return _stream_broken(exc)

    async def pipe(self, write: Callable[[bytes], None]) -> None:
        """Pass the whole stream to ``write``, called from the upstream connection's callbacks
        as each chunk arrives (no task wakes per chunk); returns once the stream has ended.

        ``hold`` and ``release`` pause and resume the upstream meanwhile (back-pressure).
        """
        conn = self._conn

        def sink(chunk: bytes) -> None:
            chunk = self._renamed(chunk)
            if chunk:
                write(chunk)

        try:
            conn.relay_to(sink)
            await conn.finished()
        except UpstreamBroken as exc:
            self._end()
            write(_stream_broken(exc))
            return
        finally:
            conn.relay_to(None)
        self._end()
        tail = self._tail()
        if tail:
            write(tail)

    def _renamed(self, chunk: bytes) -> bytes:
        """``chunk`` with the model renamed and its usage noted; whole events only (a chunk may
        end in the middle of one: the rest waits in the splitter for the next)."""
        if self._events is None:
            return chunk
        if self._too_large is not None:  # given up on: the rest of the read it came in
            return b""
        try:
            events = self._events.feed(chunk)
        except UpstreamTooLarge as exc:
            self._too_large = exc
            self._conn.give_up(exc)  # what waits on the connection ends with this error
            return b""
        return self._rewritten(events) if events else b""

    def _rewritten(self, events: bytes) -> bytes:
        observation = self._observation
        if observation is not None and b'"usage"' in events:
            at = observation.note_usage(events)
            if at >= 0 and observation.usage_added:  # asked for by the gateway: not passed on
                start, end = event_around(events, at)
                events = events[:start] + events[end:]
        return events if self._rename is None else self._rename.model_field(events)

    def _tail(self) -> bytes:
        if self._too_large is not None:
            return _stream_broken(self._too_large)
        tail = b"" if self._events is None else self._events.rest()
        return self._rewritten(tail) if tail else tail

    def hold(self) -> None:
        self._conn.hold()

    def release(self) -> None:
        self._conn.release()

    def _end(self) -> None:
        self._ended = True
        if self._observation is not None:
            self._observation.upstream_seconds += time.perf_counter() - self._started

    def abort(self) -> None:
        """The client went away: cut the upstream connection, so the engine stops generating."""
        if not self._ended:
            self._conn.abort()

    def close(self) -> None:
        """Give the connection back (or drop it, if unfinished) and end the lease; idempotent."""
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            self._pool.give_back(self._origin, self._conn)
            on_done()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch_client() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.abort()
                    return

        watcher = asyncio.get_running_loop().create_task(watch_client())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            while (chunk := await self.read()) is not None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._ended = True
            watcher.cancel()
            self.close()

    def __del__(self) -> None:
        # Built but never sent (the client left before the route returned): free the lease.
        on_done = getattr(self, "_on_done", None)
        if on_done is not None:
            self._on_done = None
            self._conn.abort()
            with contextlib.suppress(Exception):
                on_done()


def _stream_broken(cause: UpstreamBroken) -> bytes:
    if isinstance(cause, UpstreamSilent):
        return error_event(
            f"{_late(cause)} (--upstream-timeout); the rest of this answer was abandoned",
            code="engine_timeout",
            status=504,
        )
    if isinstance(cause, UpstreamTooLarge):
        return error_event(
            f"the engine sent a stream event larger than {cause.limit} bytes "
            "(--max-answer-bytes); the rest of this answer was abandoned",
            code="engine_answer_too_large",
            status=502,
        )
    return error_event(
        "the engine stopped while streaming this answer; it is being restarted, retry the request",
        code="engine_stream_interrupted",
    )


__all__: list[Any] = [
    "ProxyClient",
    "RelayResponse",
    "UpstreamUnreachable",
]
