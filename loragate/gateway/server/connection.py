"""One client connection of ``gateway serve``: HTTP/1.1 parsed with httptools, with the limits
that keep slow, idle and greedy clients from taking the gateway down.

Every limit is counted here, as bytes arrive, before anything keeps them:

- ``header_timeout``: from accept to the end of the first request's headers, and from the
  first byte of each later request on a kept-alive connection to the end of its headers; a
  408 if a request had begun, else a quiet close.
- ``body_timeout``: no body byte for that long while the gateway is reading the body (not
  paused by flow control, nor waiting to send ``100 Continue``): closed. ``body_deadline``:
  the whole body not in by then, however it trickles: a 408 and a close, so a slot of
  ``limit_concurrency`` is never held for ever by a body sent a byte at a time.
- ``write_timeout``: the send buffer full (``pause_writing``) and not drained for that long:
  closed at once, which stops the engine's work for it.
- ``max_header_bytes`` and ``max_headers``: per request, however requests arrive (pipelined
  ones included); past either, a 431 and a close. Bytes are fed to the parser in slices of
  the budget, so a 1 GiB header costs what one slice holds.
- ``limit_concurrency`` counts requests being answered (``ServerState.active``), not sockets;
  past it a 503, but ``GET /health/live`` and ``GET /health`` are always answered.
- ``max_connections_per_peer``: more open connections from one address are closed at once.
- keep-alive: an idle connection is closed ``keep_alive`` seconds after its last answer.

Refusals (400, 408, 431) leave as OpenAI-style JSON, then the connection lingers shortly,
discarding what the client still sends, so the answer is not lost to a TCP reset. After an
early answer (a 401, a 413) the unread body is dropped (up to ``DRAIN_BYTES``, else a close):
it is never parsed as a next request. Pipelined requests are answered one at a time, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httptools
import orjson

from loragate.gateway.errors import OpenAIError
from loragate.gateway.server import hot_routes
from loragate.gateway.server.exchange import HIGH_WATER, Exchange, head_lines

if TYPE_CHECKING:
    from loragate.gateway.runtime import Gateway
    from loragate.settings.request_limits import RequestLimitFields

log = logging.getLogger("loragate.gateway")

ALWAYS_ANSWERED = frozenset({"/health/live", "/health", "/v1/health"})
"""GET routes answered past ``limit_concurrency``: a saturated gateway is alive, and the
probes (the Kubernetes liveness probe restarts the pod on a 503) must say so."""

DRAIN_BYTES = 1024 * 1024
"""The most of an unread request body read and dropped after an early answer (a 401, a 413),
so the connection stays in step for the client's next request; more, and it is closed."""

LINGER_SECONDS = 2.0
"""After a refusal or an early answer, how long the connection keeps reading (and dropping)
what the client still sends, so the answer reaches it before the close; a reset would
discard it."""

_IDLE, _HEAD, _BODY = 0, 1, 2  # where the connection is in the request it is reading


class NoteOnce:
    """One log line per kind of close every ``every`` seconds, however many an attacker makes."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.last: dict[str, float] = {}
        self.quiet: dict[str, int] = {}

    def __call__(self, kind: str, level: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -self.every) < self.every:
            self.quiet[kind] = self.quiet.get(kind, 0) + 1
            return
        self.last[kind] = now
        more = self.quiet.pop(kind, 0)
        log.log(
            level, message + (f" ({more} more since the last such line)" if more else ""), *args
        )


@dataclass(eq=False)
class ServerState:
    """What every connection of one server shares: the app, the limits and the counts."""

    app: Any  # the ASGI app
    limits: RequestLimitFields
    keep_alive: float
    gateway: Gateway | None = None  # answers the hot routes itself when set
    connections: set[Connection] = field(default_factory=set)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    peers: dict[str, int] = field(default_factory=dict)
    note: NoteOnce = field(default_factory=NoteOnce)
    shutting_down: bool = False

    @property
    def active(self) -> int:
        """Requests being answered, on every connection."""
        return len(self.tasks)


class Connection(asyncio.Protocol):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.limits = state.limits
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.answering: Exchange | None = None  # the request being answered
        self.task: asyncio.Task[Any] | None = None  # and its task
        self.task_is_hot = False  # a hot route's: cancelled when its client leaves
        self.waiting: deque[Exchange] = deque()  # pipelined requests, in order
        self.reading: Exchange | None = None  # the request whose body is being parsed
        self.write_paused = False
        self._drained: asyncio.Event | None = None
        self._read_paused = False
        self._phase = _IDLE
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # this request's line and headers, as the parser gives them
        self._fed = 0  # bytes fed to the parser since the last head ended (its memory bound)
        self._refused: tuple[int, str, str] | None = None  # a refusal waiting for answers
        self._draining: Exchange | None = None  # answered early: its body is read and dropped
        self._drain_left = 0
        self._closing = False  # refusing or lingering: what arrives is dropped
        self._peer: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due = 0.0  # the body's deadline (loop time)
        self._body_at = 0.0  # when body bytes last arrived (loop time)
        self._body_checked = 0.0  # the body deadline's last look (loop time)
        self._write_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self.relaying: Any = None  # a hot route's stream being relayed (``RelayResponse``)

    # ----- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        local = transport.get_extra_info("sockname")
        self.client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
        self.local = (str(local[0]), int(local[1])) if isinstance(local, tuple) else None
        state = self.state
        cap = self.limits.max_connections_per_peer
        if cap is not None:
            peer_host = self.client[0] if self.client else ""
            open_now = state.peers.get(peer_host, 0)
            if open_now >= cap:
                state.note(
                    "peer",
                    logging.INFO,
                    "closed a connection from %s: it has %d open",
                    peer_host,
                    cap,
                )
                transport.abort()  # type: ignore[attr-defined]
                return
            state.peers[peer_host] = open_now + 1
            self._peer = peer_host
        state.connections.add(self)
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        state = self.state
        state.connections.discard(self)
        for timer in (self._head_timer, self._body_timer, self._write_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._write_timer = self._idle_timer = None
        if self._peer is not None:
            left = state.peers.get(self._peer, 1) - 1
            if left > 0:
                state.peers[self._peer] = left
            else:
                state.peers.pop(self._peer, None)
            self._peer = None
        for exchange in (self.answering, self.reading, *self.waiting):
            if exchange is not None:
                exchange.gone()
        self.waiting.clear()
        if self._drained is not None:
            self._drained.set()
        if self.relaying is not None:
            self.relaying.abort()  # the engine stops generating for a client that left
        elif self.task is not None and self.task_is_hot:
            # Nobody will read this answer: the task's engine connection is cut, so the
            # engine aborts the generation, and the adapter lease ends now.
            self.task.cancel()
        self.task = None

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # lingering after a refusal: read and drop
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        budget = self.limits.max_header_bytes
        view = memoryview(data)
        try:
            while view:
                if self._phase == _BODY:
                    piece, view = view, view[:0]
                else:  # at most the budget at a time: a head can hold no more than that
                    piece, view = view[:budget], view[budget:]
                    self._fed += len(piece)
                self.parser.feed_data(piece)
                if self._closing:
                    return
                if self._phase != _BODY and self._fed > budget:
                    self._refuse_too_large()
                    return
        except httptools.HttpParserUpgrade:
            # An Upgrade this server does not make (no websockets): the request is answered
            # as plain HTTP/1.1 (RFC 9110 lets a server ignore it), then the connection closes.
            for exchange in (self.reading, *self.waiting, self.answering):
                if exchange is not None:
                    exchange.keep_alive = False
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, f"the request is not valid HTTP/1.1: {exc}", "invalid_http")
            return
        if self._phase == _BODY:
            self._body_at = self.loop.time()
        elif self._head_timer is None and (self._phase == _HEAD or self.answering is None):
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_deadline)

    # ----- flow control -------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.write_timeout, self._write_deadline
            )

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._drained is not None:
            self._drained.set()
        if self.relaying is not None:
            self.relaying.release()

    async def drained(self) -> None:
        """Until the client has read enough of the answer (or left)."""
        if not self.write_paused or self.transport.is_closing():
            return
        if self._drained is None:
            self._drained = asyncio.Event()
        self._drained.clear()
        await self._drained.wait()

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def _pause_reading(self) -> None:
        if not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused and not self.waiting:
            self._read_paused = False
            self.transport.resume_reading()

    def wants_body(self, exchange: Exchange) -> None:
        """``exchange``'s app waits for body bytes: read the socket again."""
        if exchange is self.reading and len(exchange.body) < HIGH_WATER:
            self._body_at = self.loop.time()  # the wait for the client starts now
            self._resume_reading()

    # ----- the parser's callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _HEAD
        self._url = b""
        self._headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._headers.append((name.lower(), value))
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse_too_large()

    def on_headers_complete(self) -> None:
        if self._closing:
            return
        limits = self.limits
        if len(self._headers) > limits.max_headers:
            self._refuse(
                431, f"the request has more than {limits.max_headers} headers", "too_many_headers"
            )
            return
        self._phase = _BODY
        self._fed = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        parser = self.parser
        parsed = httptools.parse_url(self._url)
        raw_path = parsed.path
        path = raw_path.decode("ascii", "surrogateescape")
        if b"%" in raw_path:
            from urllib.parse import unquote

            path = unquote(path)
        headers = self._headers
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": parser.get_http_version(),
            "server": self.local,
            "client": self.client,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": headers,
            "state": {},
        }
        expect_100 = any(
            name == b"expect" and value.lower() == b"100-continue" for name, value in headers
        )
        exchange = Exchange(
            self,
            scope,
            keep_alive=parser.should_keep_alive() and not self.state.shutting_down,
            expect_100=expect_100,
        )
        self.reading = exchange
        now = self.loop.time()
        self._body_at = self._body_checked = now
        self._body_due = now + limits.body_deadline
        first_look = min(limits.body_timeout, limits.body_deadline)  # whichever comes first
        self._body_timer = self.loop.call_later(first_look, self._body_deadline)
        if self.answering is None:
            self._start(exchange)
        else:  # pipelined: it waits, and nothing more is read, until the one before is answered
            self.waiting.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.reading
        if exchange is None or self._closing:
            return
        if exchange is self._draining:
            self._drain_left -= len(body)
            if self._drain_left < 0:  # more than an early answer's body is worth reading
                self.transport.close()
            return
        exchange.feed(body)
        if len(exchange.body) > HIGH_WATER:
            self._pause_reading()

    def on_message_complete(self) -> None:
        if self._closing:
            return
        self._phase = _IDLE
        self._fed = 0
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        exchange = self.reading
        self.reading = None
        if exchange is not None:
            exchange.end()
            if exchange is self._draining:
                self._draining = None
                self._next(exchange)

    # ----- answering ----------------------------------------------------------------------

    def _start(self, exchange: Exchange) -> None:
        """Admit ``exchange`` (``limit_concurrency`` counts requests being answered) and
        start its task: a hot route's, the app's, or the 503 of a gateway at its limit."""
        state = self.state
        self.answering = exchange
        scope = exchange.scope
        limit = self.limits.limit_concurrency
        hot = None
        if state.active >= limit and (
            scope["path"] not in ALWAYS_ANSWERED or scope["method"] not in ("GET", "HEAD")
        ):
            state.note(
                "busy", logging.WARNING, "%d requests at once (--limit-concurrency): a 503", limit
            )
            work: Any = exchange.answer_busy(limit)
        elif state.gateway is not None and scope["method"] == "POST":
            hot = hot_routes.endpoint_for(scope["path"])
            work = (
                hot_routes.answer(state.gateway, exchange, hot)
                if hot is not None
                else exchange.run_app(state.app)
            )
        else:
            work = exchange.run_app(state.app)
        task = self.loop.create_task(work)
        self.task = task
        self.task_is_hot = hot is not None
        state.tasks.add(task)
        task.add_done_callback(state.tasks.discard)

    def can_drain(self, exchange: Exchange) -> bool:
        """Whether the rest of ``exchange``'s unread body is small enough to read and drop
        after an early answer (a 401, a 413), keeping the connection: else it closes."""
        for name, value in exchange.scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value) - exchange.received <= DRAIN_BYTES
                except ValueError:
                    return False
        return True  # chunked: read up to DRAIN_BYTES more, then closed

    def answered(self, exchange: Exchange) -> None:
        """``exchange``'s answer is complete: close, linger or keep alive; the next starts."""
        if exchange is not self.answering:
            return
        self.answering = None
        self.task = None
        if self.transport.is_closing():
            return
        if exchange.more_body and exchange.keep_alive and exchange is self.reading:
            self._draining = exchange  # the next request starts after this body's end
            self._drain_left = DRAIN_BYTES
            self._drain_left -= len(exchange.body)
            exchange.body.clear()
            self._read_paused = False
            self.transport.resume_reading()
            return
        self._next(exchange)

    def _next(self, exchange: Exchange) -> None:
        if not exchange.keep_alive or self.state.shutting_down:
            if exchange.more_body:  # its body was never read: linger, so the answer lands
                self._linger()
            else:
                self.transport.close()
            return
        if self.waiting:
            self._start(self.waiting.popleft())
            self._resume_reading()
            return
        if self._refused is not None:
            status, message, code = self._refused
            self._refuse(status, message, code)
            return
        self._resume_reading()
        if self._phase == _IDLE and self._head_timer is None:
            self._idle_timer = self.loop.call_later(self.state.keep_alive, self._idle_deadline)

    def shutdown(self) -> None:
        """The server is stopping: close now when idle, after the answer otherwise."""
        if self.answering is None and self.reading is None:
            self.transport.close()

    # ----- deadlines and refusals ---------------------------------------------------------

    def _idle_deadline(self) -> None:
        self._idle_timer = None
        if self.answering is None and self._phase == _IDLE:
            self.transport.close()

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self._phase == _BODY or self._closing:
            return
        if self._phase == _IDLE:
            if self.answering is None:  # connected (or kept alive, then a stray byte): nothing
                self.state.note(
                    "idle",
                    logging.INFO,
                    "closed a connection that sent no request within its deadline",
                )
                self.transport.close()
            return
        self.state.note(
            "head", logging.INFO, "a 408 to a request whose headers took over the header deadline"
        )
        timeout = self.limits.header_timeout
        self._refuse(
            408, f"the request's headers did not arrive within {timeout:g} s", "request_timeout"
        )

    def _body_deadline(self) -> None:
        self._body_timer = None
        exchange = self.reading
        if self._phase != _BODY or self._closing or exchange is None:
            return
        now = self.loop.time()
        limits = self.limits
        waiting = exchange is not self.answering or len(exchange.body) >= HIGH_WATER
        if (self._read_paused and waiting) or exchange.expect_100:
            # The gateway is not reading: no progress is owed, and the time is not the body's.
            self._body_due += now - self._body_checked
            self._body_at = now
        self._body_checked = now
        if now >= self._body_due:
            self.state.note(
                "body-total",
                logging.INFO,
                "a 408 to a request whose body took over %g s in all (--body-deadline)",
                limits.body_deadline,
            )
            self._refuse(
                408,
                f"the request's body did not arrive within {limits.body_deadline:g} s",
                "request_timeout",
            )
            return
        quiet = now - self._body_at
        if quiet < limits.body_timeout:
            delay = min(limits.body_timeout - quiet, self._body_due - now)
            self._body_timer = self.loop.call_later(max(delay, 0.0), self._body_deadline)
            return
        self.state.note(
            "body", logging.INFO, "closed a connection whose request body stalled for %g s",
            limits.body_timeout,
        )  # fmt: skip
        self.transport.abort()

    def _write_deadline(self) -> None:
        self._write_timer = None
        self.state.note(
            "write",
            logging.INFO,
            "closed a connection that read nothing of its answer for %g s",
            self.limits.write_timeout,
        )
        self.transport.abort()  # close() would wait for the buffer to drain: it never does

    def _refuse_too_large(self) -> None:
        self._refuse(
            431,
            f"the request line and headers exceed {self.limits.max_header_bytes} bytes",
            "headers_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (OpenAI-style), read and drop what follows, close shortly. With
        an answer on its way, the refusal waits for it (and for those queued before it)."""
        for timer in (self._head_timer, self._body_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._idle_timer = None
        reading = self.reading
        if reading is not None and reading is not self.answering and reading in self.waiting:
            self.waiting.remove(reading)  # a pipelined request refused before its turn
        if self.answering is not None and (reading is None or reading is not self.answering):
            # Earlier requests are still being answered: refuse after them.
            self._refused = (status, message, code)
            self._closing = True
            self._pause_reading()
            return
        self._closing = True
        if reading is not None:
            reading.gone()  # its app (if it runs) sees a client that left
        if self.answering is not None and self.answering.response_started:
            self.transport.abort()  # an answer is half out: no second one on this connection
            return
        self.answering = None
        body = orjson.dumps(OpenAIError(status, message, code=code).body())
        parts = head_lines(
            status,
            ((b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))),
            close=True,
            security=True,
        )
        parts += (b"\r\n", body)
        self.transport.write(b"".join(parts))
        self._linger()

    def _linger(self) -> None:
        transport = self.transport
        self._closing = True
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.waiting.clear()
        self._read_paused = False
        transport.resume_reading()
        self._head_timer = self.loop.call_later(LINGER_SECONDS, transport.abort)
