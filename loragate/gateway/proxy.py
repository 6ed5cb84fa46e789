"""Forwarding requests to an OpenAI-compatible upstream over pooled keep-alive connections.

The body goes out as bytes; the answer comes back as bytes. The only rewrite is the
``model`` field (engine id -> the public name the client asked for), done on raw bytes, event
by event for streams, so nothing is buffered beyond one server-sent event.

Why not httpx: on this path it cost about 0.3 ms of CPU per request (request and response
objects, header models, anyio, httpcore's pool) - most of what the gateway added on top of
the engine. The upstream is one known HTTP/1.1 server, usually on loopback, so a small pool
of asyncio connections with httptools' C parser does the same job for a tenth of that. Each
connection carries one exchange at a time; idle connections go back to a per-origin stack and
are dropped when the upstream closes them or after ``idle_timeout`` (below uvicorn's 5 s
keep-alive, so we do not race the server's own close).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loragate.gateway.errors import OpenAIError, error_event
from loragate.gateway.metrics import current_observation
from loragate.plain_http import header_lines

_EVENT_END = b"\n\n"
# Past this much unread stream data, stop reading the upstream socket (TCP back-pressure).
_HIGH_WATER = 256 * 1024


class Rename:
    """Rewrite engine id ``internal`` to ``public`` in answers."""

    __slots__ = ("_field_from", "_field_to", "internal", "public")

    def __init__(self, internal: bytes, public: bytes) -> None:
        self.internal = internal
        self.public = public
        self._field_from = b'"model":"' + internal + b'"'
        self._field_to = b'"model":"' + public + b'"'

    @classmethod
    @lru_cache(maxsize=256)
    def of(cls, internal: str, public: str) -> Rename | None:
        if internal == public:
            return None
        return cls(internal.encode(), public.encode())

    def model_field(self, data: bytes) -> bytes:
        return data.replace(self._field_from, self._field_to)

    def everywhere(self, data: bytes) -> bytes:
        return data.replace(self.internal, self.public)


class UpstreamUnreachable(OpenAIError):
    """Nothing listens upstream any more: the request is safe to send again once it is back.

    ``maybe_delivered`` marks the one case where an earlier copy of the request may have
    reached the upstream before it died (a kept-alive connection broke under it): that copy
    may be what killed it, so a caller resends such a request at most once.
    """

    maybe_delivered = False


class UpstreamBroken(Exception):
    """The upstream connection failed or sent something that is not HTTP/1.1."""


# ----- one upstream connection ----------------------------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one exchange at a time.

    httptools calls ``on_*`` while ``data_received`` feeds it; they only record and wake the
    one coroutine waiting on this connection (``_waiter``), never raise.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.exchanges = 0
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = b"application/json"
        self.got_bytes = False
        self.head_done = False
        self.complete = False
        self.error: BaseException | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._until_close = True
        self._keep_alive = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"the upstream sent a malformed response: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and self._until_close and exc is None:
            self.complete = True  # a body delimited by the connection's end
            self._wake()
            return
        if not self.complete:
            self._fail(UpstreamBroken(f"the upstream closed the connection ({exc or 'EOF'})"))

    def pause_writing(self) -> None:  # request bodies are small; the kernel buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value
        elif lower in (b"content-length", b"transfer-encoding"):
            self._until_close = False

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200:
            return  # 100 Continue or 103 Early Hints: the answer follows on the connection
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink(body)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER:
            self.hold()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head_done:  # the end of an interim (1xx) answer: its headers say nothing
            self.content_type = b"application/json"
            self._until_close = True
            return
        # Only valid here: once feed_data returns, the parser has reset for the next message.
        self._keep_alive = self._parser.should_keep_alive()
        self.complete = True
        self._wake()

    # the exchange, seen from the coroutine that owns it

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self._sink = None
        self.exchanges += 1
        self.transport.write(data)

    async def head(self) -> None:
        while not self.head_done:
            await self._wait()

    async def read_all(self) -> bytes:
        while not self.complete:
            await self._wait()
        body = b"".join(self._body)
        self._body.clear()
        return body

    async def next_chunk(self) -> bytes | None:
        """Body bytes received since the last call; None once the body is complete."""
        while not self._body:
            if self.complete:
                return None
            await self._wait()
        chunk = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        self.release()
        return chunk

    def relay_to(self, sink: Callable[[bytes], None] | None) -> None:
        """Hand body bytes to ``sink`` as they arrive, from the parser's callback: no
        buffering and no task to wake per chunk. What arrived before goes to it first."""
        if sink is not None and self._body:
            early = b"".join(self._body)
            self._body.clear()
            self._buffered = 0
            sink(early)
        self._sink = sink
        self.release()

    async def finished(self) -> None:
        """Wait for the end of the body (relayed to a sink meanwhile)."""
        while not self.complete:
            await self._wait()

    def hold(self) -> None:
        """Stop reading the upstream socket (TCP back-pressure) until ``release``."""
        if not self._paused and not self.closed and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def release(self) -> None:
        if self._paused and not self.closed and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    @property
    def reusable(self) -> bool:
        return self.complete and not self.closed and self._keep_alive

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None
        if self.error is not None and not self.complete:
            raise self.error

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()


# ----- the pool -------------------------------------------------------------------------------

# scheme, host, port, and the Unix socket to connect to instead of host and port ("" for none)
Origin = tuple[str, str, int, str]


@dataclass(frozen=True)
class _Target:
    origin: Origin
    request_line: bytes  # b"POST /v1/... HTTP/1.1\r\nHost: ...\r\n"


@lru_cache(maxsize=64)
def _target(url: str, method: str = "POST", uds: str | None = None) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"cannot proxy to {url!r}: an http(s) URL is needed")
    if uds is not None and parts.scheme != "http":
        raise ValueError(f"cannot proxy to {url!r} over a Unix socket: plain http:// only")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    host = parts.netloc.rpartition("@")[2]
    line = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
    return _Target((parts.scheme, parts.hostname, port, uds or ""), line)


def _request_bytes(target: _Target, headers: dict[str, str], body: bytes) -> bytes:
    length = b"Content-Length: %d\r\n" % len(body)
    return b"".join((target.request_line, length, header_lines(headers), b"\r\n", body))


class _Pool:
    def __init__(self, connect_timeout: float, idle_timeout: float, max_idle: int) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: dict[Origin, list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def take_idle(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        if not stack:
            return None
        oldest_ok = time.monotonic() - self.idle_timeout
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.idle_since >= oldest_ok:
                return conn
            conn.abort()
        return None

    async def connect(self, origin: Origin) -> _Connection:
        scheme, host, port, uds = origin
        loop = asyncio.get_running_loop()
        if uds:
            _, unix_conn = await asyncio.wait_for(
                loop.create_unix_connection(_Connection, uds), self.connect_timeout
            )
            return unix_conn
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Connection, host, port, ssl=tls), self.connect_timeout
        )
        return conn

    def give_back(self, origin: Origin, conn: _Connection) -> None:
        if not conn.reusable:
            conn.abort()
            return
        stack = self._idle.setdefault(origin, [])
        if len(stack) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    def close(self) -> None:
        for stack in self._idle.values():
            for conn in stack:
                conn.abort()
        self._idle.clear()


# ----- the client the backends use ------------------------------------------------------------


class ProxyClient:
    """POSTs OpenAI requests upstream and turns the answers into ASGI responses."""

    def __init__(
        self, connect_timeout: float = 10.0, idle_timeout: float = 4.0, max_idle: int = 256
    ) -> None:
        self._pool = _Pool(connect_timeout, idle_timeout, max_idle)

    async def aclose(self) -> None:
        self._pool.close()

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
        """POST ``body`` to ``url``; ``on_done`` runs exactly once, when the answer is complete.

        With ``uds``, connect to that Unix socket instead of the URL's host and port; with
        ``method``, send that instead of POST (the engine's GET routes).
        """
        extra = response_headers or {}
        observation = current_observation.get()
        started = time.perf_counter()
        target = _target(url, method, uds)
        try:
            conn = await self._exchange(target, _request_bytes(target, headers, body))
        except UpstreamUnreachable as exc:
            on_done()
            exc.headers = {**exc.headers, **extra}
            raise
        except (UpstreamBroken, OSError, TimeoutError, ValueError) as exc:
            on_done()
            raise OpenAIError(
                503,
                f"the engine did not answer ({type(exc).__name__}); retry shortly",
                code="engine_unavailable",
                headers={"Retry-After": "5", **extra},
            ) from exc
        if not stream or conn.status != 200:
            try:
                content = await conn.read_all()
            except UpstreamBroken as exc:
                on_done()
                raise OpenAIError(
                    503,
                    "the engine stopped while answering; retry",
                    code="engine_unavailable",
                    headers={"Retry-After": "5", **extra},
                ) from exc
            finally:
                self._pool.give_back(target.origin, conn)
            on_done()
            if observation is not None:
                observation.upstream_seconds += time.perf_counter() - started
            if rename is not None:
                content = (
                    rename.model_field(content) if conn.status < 400 else rename.everywhere(content)
                )
            return _Answer(content, conn.status, conn.content_type, extra)
        return _RelayResponse(
            self._pool, target.origin, conn, rename, on_done, started,
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **extra},
        )  # fmt: skip

    async def _exchange(self, target: _Target, request: bytes) -> _Connection:
        """Send ``request`` and wait for the answer's head; the connection is the caller's."""
        conn = self._pool.take_idle(target.origin)
        if conn is not None:
            conn.send(request)
            try:
                await conn.head()
                return conn
            except UpstreamBroken:
                conn.abort()
                if conn.got_bytes:
                    raise
                # A kept-alive connection the upstream closed just as we reused it: nothing
                # was answered, so send once more on a fresh connection. If that one cannot
                # even connect, the first attempt may still have reached the engine, so this
                # is not reported as "unreachable" (which the backend would resend)...
                try:
                    conn = await self._pool.connect(target.origin)
                except (ConnectionRefusedError, FileNotFoundError) as exc:
                    # ...unless nothing listens any more: the engine died, taking whatever the
                    # first attempt started with it (generation has no side effects), so the
                    # backend may wait for the restart and send it again.
                    raise _died() from exc
                except OSError as exc:
                    raise UpstreamBroken(f"the upstream went away: {exc}") from exc
                return await self._first_answer(conn, request)
        try:
            conn = await self._pool.connect(target.origin)
        except (
            ConnectionRefusedError,
            ConnectionResetError,
            FileNotFoundError,
            TimeoutError,
        ) as exc:
            raise UpstreamUnreachable(
                503,
                "the engine is not reachable; retry shortly",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            ) from exc
        except OSError as exc:
            raise UpstreamUnreachable(
                503,
                f"the engine is not reachable ({exc.strerror or exc}); retry shortly",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            ) from exc
        return await self._first_answer(conn, request)

    async def _first_answer(self, conn: _Connection, request: bytes) -> _Connection:
        """Send ``request`` on a new connection and wait for the answer's head."""
        conn.send(request)
        try:
            await conn.head()
        except UpstreamBroken as exc:
            conn.abort()
            if conn.got_bytes:
                raise
            # A new connection cut before a byte of answer: the engine is dying (its listener
            # took the connection just before going). Like a refused one, but the request may
            # have reached the engine, so the backend resends it at most once.
            raise _died() from exc
        except BaseException:
            conn.abort()
            raise
        return conn


def _died() -> UpstreamUnreachable:
    """The engine went away with this request maybe delivered to it."""
    unreachable = UpstreamUnreachable(
        503,
        "the engine is not reachable; retry shortly",
        code="engine_unavailable",
        headers={"Retry-After": "5"},
    )
    unreachable.maybe_delivered = True
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


class _RelayResponse(Response):
    """A server-sent event stream relayed chunk by chunk from an upstream connection.

    Lighter than Starlette's StreamingResponse (no task group per request): one small task
    watches for the client going away and cuts the upstream connection, which makes the
    engine abort the generation. ``hot_protocol`` drives the same ``read``/``close``/``abort``
    without ASGI.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        pool: _Pool,
        origin: Origin,
        conn: _Connection,
        rename: Rename | None,
        on_done: Callable[[], None],
        started: float,
        headers: dict[str, str],
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
        self._pending = b""
        self._ended = False
        self._observation = current_observation.get()

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
        except UpstreamBroken:
            self._end()
            return _stream_broken()

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
        except UpstreamBroken:
            self._end()
            write(_stream_broken())
            return
        finally:
            conn.relay_to(None)
        self._end()
        tail = self._tail()
        if tail:
            write(tail)

    def _renamed(self, chunk: bytes) -> bytes:
        """``chunk`` with the model renamed; whole events only (a chunk may end in the middle
        of one: the rest waits in ``_pending`` for the next)."""
        rename = self._rename
        if rename is None:
            return chunk
        if self._pending:
            chunk, self._pending = self._pending + chunk, b""
        if not chunk.endswith(_EVENT_END):
            cut = chunk.rfind(_EVENT_END)
            if cut < 0:
                self._pending = chunk
                return b""
            cut += len(_EVENT_END)
            chunk, self._pending = chunk[:cut], chunk[cut:]
        return rename.model_field(chunk)

    def _tail(self) -> bytes:
        tail, self._pending = self._pending, b""
        if tail and self._rename is not None:
            return self._rename.model_field(tail)
        return tail

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


def _stream_broken() -> bytes:
    return error_event(
        "the engine stopped while streaming this answer; it is being restarted, retry the request",
        code="engine_stream_interrupted",
    )


__all__: list[Any] = ["ProxyClient", "Rename", "UpstreamUnreachable"]
