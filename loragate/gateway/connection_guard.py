"""Connection hygiene for ``gateway serve``: deadlines, a header budget, requests counted.

uvicorn's httptools protocol has no deadline for a client that connects and sends nothing,
or sends its headers a byte a second, or stops sending its body, or never reads its answer
(its keep-alive timer starts only after a first answer); the parser keeps a header however
long it grows; and ``--limit-concurrency`` counts open sockets, so idle ones fill it and every
route answers 503, ``/health/live`` included. ``GuardedProtocol`` is that protocol with:

- ``header_timeout``: from accept to the end of the first request's headers, and from the
  first byte of each later request on a kept-alive connection to the end of its headers; a
  408 if a request had begun, else a quiet close.
- ``body_timeout``: no body byte for that long while the body is incomplete and the gateway
  is reading it (not paused by flow control, nor waiting to send ``100 Continue``): closed.
- ``write_timeout``: the transport's send buffer full (``pause_writing``) and not drained for
  that long: closed at once, and ``connection_lost`` lets the hot path stop the engine.
- ``max_header_bytes`` and ``max_headers``: counted as bytes arrive, before the parser keeps
  them, so a 1 GiB header costs what one read holds; past either, a 431 and a close.
- ``limit_concurrency`` counts requests being answered, not sockets; past it a 503, but
  ``GET /health/live`` and ``GET /health`` are always answered (probes must see the truth).
- ``max_connections_per_peer``: more open connections from one address are closed at once.

Refusals (408, 431) leave as OpenAI-style JSON, then the connection lingers shortly,
discarding what the client still sends, so the answer is not lost to a TCP reset.

The hot protocol (``hot_protocol``) subclasses this one, and ``server_options`` serves with
one of the two whenever it has the gateway's settings, so the same limits hold on the hot
path and on plain ASGI. Everything it touches of uvicorn is the parser callbacks, the asyncio
protocol methods and a few attributes, imported behind a guard: ``uvicorn_fit.guard_unfit``
says whether the installed uvicorn still has them, and where it does not ``gateway serve``
refuses to start rather than serve without these limits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Self, cast

import orjson

from loragate.gateway.errors import OpenAIError
from loragate.gateway.security_headers import SECURITY_HEADERS
from loragate.gateway.uvicorn_fit import STATUS_LINE, HttpToolsProtocol
from loragate.settings.request_limits import RequestLimitFields

log = logging.getLogger("loragate.gateway")

SECURITY_LINES = b"".join(name + b": " + value + b"\r\n" for name, value in SECURITY_HEADERS)
"""The security headers, written out as header lines (for answers written without ASGI)."""

ALWAYS_ANSWERED = frozenset({"/health/live", "/health", "/v1/health"})
"""GET routes answered past ``limit_concurrency``: a saturated gateway is alive, and the
probes (the Kubernetes liveness probe restarts the pod on a 503) must say so."""

LINGER_SECONDS = 2.0
"""After a 408 or 431, how long the connection keeps reading (and dropping) what the client
still sends, so the answer reaches it before the close; a reset would discard it."""

_IDLE, _HEAD, _BODY = 0, 1, 2  # where the connection is in its current request


class _NoteOnce:
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


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and budgets above (``bound_to`` gives
    the class that ``uvicorn.run(http=...)`` takes)."""

    limits: RequestLimitFields
    peers: dict[str, int]  # open connections per client address, for this server
    note: _NoteOnce

    @classmethod
    def bound_to(cls, limits: RequestLimitFields, **attributes: Any) -> type[Self]:
        """This protocol class with ``limits`` (the gateway's settings) and its own counts."""
        values = {"limits": limits, "peers": {}, "note": _NoteOnce(), **attributes}
        return cast(type[Self], type(cls.__name__, (cls,), values))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._head_bytes = 0  # of the request being read, or the next one
        self._ended_message = False  # a request ended in the data just parsed
        self._refusing = False  # a 408 or 431 is out: drop what follows
        self._peer: str | None = None  # counted in ``peers``
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_at = 0.0  # when the last body bytes arrived (loop time)
        self._write_timer: asyncio.TimerHandle | None = None

    # ----- the connection -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections_per_peer
        if cap is not None:
            peer = str(self.client[0]) if self.client else ""
            open_now = self.peers.get(peer, 0)
            if open_now >= cap:
                self.note(
                    "peer", logging.INFO, "closed a connection from %s: it has %d open", peer, cap
                )
                transport.abort()
                return
            self.peers[peer] = open_now + 1
            self._peer = peer
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._write_timer = None
        if self._peer is not None:
            left = self.peers.get(self._peer, 1) - 1
            if left > 0:
                self.peers[self._peer] = left
            else:
                self.peers.pop(self._peer, None)
            self._peer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return  # lingering after a refusal: read and drop
        budget = self.limits.max_header_bytes
        view: bytes | memoryview = data
        while True:
            if self._phase == _BODY or len(view) <= budget - self._head_bytes:
                if self._phase != _BODY:
                    self._head_bytes += len(view)
                super().data_received(cast(bytes, view))
                break
            # More than the header budget has room for: parse only what fits, then look.
            room = budget - self._head_bytes
            if room <= 0:
                self._refuse_too_large()
                return
            if isinstance(view, bytes):
                view = memoryview(view)
            self._head_bytes += room
            super().data_received(cast(bytes, view[:room]))
            view = view[room:]
            if self._refusing or self.transport.is_closing():
                return
        if self._refusing or self.transport.is_closing():
            return
        if self._phase == _BODY:
            self._body_at = self.loop.time()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(
                    self.limits.body_timeout, self._body_deadline
                )
        elif self._head_timer is None and (self._phase == _HEAD or not self._ended_message):
            # a request begun and not yet whole (or bytes before one): its headers' deadline
            self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_deadline)
        self._ended_message = False

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(
                self.limits.write_timeout, self._write_deadline
            )

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    # ----- the parser's callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _HEAD
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        # Counted once the headers are whole (the byte budget already bounds what they hold):
        # an ``on_header`` of its own would cost a Python call per header of every request.
        if self._refusing:
            return
        if len(self.headers) > self.limits.max_headers:
            self._refuse(
                431,
                f"the request has more than {self.limits.max_headers} headers",
                "too_many_headers",
            )
            return
        self._phase = _BODY
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refusing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refusing:
            return
        self._phase = _IDLE
        self._head_bytes = 0
        self._ended_message = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, as an OpenAI-style error."""
        if not self._refusing:
            self._refuse(400, f"the request is not valid HTTP/1.1: {msg}", "invalid_http")

    # ----- admission ----------------------------------------------------------------------

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """Admit the request (``limit_concurrency`` counts requests being answered), then
        ``start_request``; uvicorn calls this when the request's headers are complete, or,
        pipelined, when the one before it is answered."""
        limit = self.limits.limit_concurrency
        if len(self.tasks) >= limit and app is self.app:
            scope = cycle.scope
            if scope["path"] not in ALWAYS_ANSWERED or scope["method"] not in ("GET", "HEAD"):
                self.note(
                    "busy",
                    logging.WARNING,
                    "%d requests at once (--limit-concurrency): a 503",
                    limit,
                )
                app = self._answer_busy
        self.start_request(cycle, app)

    def start_request(self, cycle: Any, app: Any) -> None:
        """Run one admitted request (the hot protocol answers its own routes here)."""
        super()._start_asgi_task(cycle, app)

    async def _answer_busy(self, scope: Any, receive: Any, send: Any) -> None:
        error = OpenAIError(
            503,
            f"the gateway is answering {self.limits.limit_concurrency} requests, its limit "
            "(--limit-concurrency); retry shortly",
            code="concurrency_limit",
            headers={"Retry-After": "1", "Connection": "close"},
        )
        response = error.response()
        response.raw_headers += SECURITY_HEADERS
        await response(scope, receive, send)

    # ----- deadlines and refusals ---------------------------------------------------------

    def _in_flight(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    def _head_deadline(self) -> None:
        self._head_timer = None
        if self._phase == _BODY or self._refusing:
            return
        in_flight = self._in_flight()
        if self._phase == _IDLE:
            if not in_flight:  # connected (or kept alive, then a stray byte) and sent nothing
                self.note(
                    "idle",
                    logging.INFO,
                    "closed a connection that sent no request within its deadline",
                )
                self.transport.close()
            return
        if in_flight:  # a pipelined request's headers, dribbling in beside an answer
            self.transport.abort()
            return
        self.note(
            "head", logging.INFO, "a 408 to a request whose headers took over the header deadline"
        )
        timeout = self.limits.header_timeout
        self._refuse(
            408, f"the request's headers did not arrive within {timeout:g} s", "request_timeout"
        )

    def _body_deadline(self) -> None:
        self._body_timer = None
        if self._phase != _BODY or self._refusing:
            return
        now = self.loop.time()
        cycle = self.cycle
        if self.flow.read_paused or getattr(cycle, "waiting_for_100_continue", False):
            self._body_at = now  # the gateway is not reading: no progress is owed
        timeout = self.limits.body_timeout
        quiet = now - self._body_at
        if quiet < timeout:
            self._body_timer = self.loop.call_later(timeout - quiet, self._body_deadline)
            return
        self.note(
            "body", logging.INFO, "closed a connection whose request body stalled for %g s", timeout
        )
        self.transport.abort()

    def _write_deadline(self) -> None:
        self._write_timer = None
        timeout = self.limits.write_timeout
        self.note(
            "write",
            logging.INFO,
            "closed a connection that read nothing of its answer for %g s",
            timeout,
        )
        self.transport.abort()  # close() would wait for the buffer to drain: it never does

    def _refuse_too_large(self) -> None:
        self._refuse(
            431,
            f"the request line and headers exceed {self.limits.max_header_bytes} bytes",
            "headers_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` (OpenAI-style), read and drop what follows, close shortly."""
        self._refusing = True
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._body_timer = None
        transport = self.transport
        if self._in_flight():  # an answer is on its way on this connection: do not interleave
            transport.abort()
            return
        body = orjson.dumps(OpenAIError(status, message, code=code).body())
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n",
            SECURITY_LINES,
            b"\r\n",
            body,
        )
        transport.write(b"".join(parts))
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._head_timer = self.loop.call_later(LINGER_SECONDS, transport.abort)
