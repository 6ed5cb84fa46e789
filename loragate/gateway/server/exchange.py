"""One request and its answer on a connection: the ASGI ``receive`` and ``send`` of it, and
the bytes its answer leaves as.

An ``Exchange`` is made when a request's headers are whole (``connection``) and lives until its
answer is complete or the client is gone. Its body arrives through ``feed`` and ``end``, and
the app (or a hot route) takes it with ``receive``; the answer goes out through ``send`` (ASGI
messages) or ``write_whole`` (a complete answer, head and body in one write, so the client
wakes once). What HTTP/1.1 asks of a server's answer is decided here: ``content-length`` when
the whole body is known, chunked otherwise, no body to a HEAD, ``connection: close`` when the
request asked for it or its body was not read to the end, ``100 Continue`` once the app reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol

from loragate.gateway.access.security_headers import SECURITY_HEADERS
from loragate.gateway.errors import OpenAIError

log = logging.getLogger("loragate.gateway")


class Connection(Protocol):
    """What an exchange asks of its connection (``connection.Connection``)."""

    transport: Any
    write_paused: bool
    relaying: Any  # a hot route's stream being relayed

    def write(self, data: bytes) -> None: ...
    async def drained(self) -> None: ...
    def wants_body(self, exchange: Exchange) -> None: ...
    def can_drain(self, exchange: Exchange) -> bool: ...
    def answered(self, exchange: Exchange) -> None: ...


SECURITY_LINES = b"".join(name + b": " + value + b"\r\n" for name, value in SECURITY_HEADERS)
"""The security headers, written out as header lines (for answers written without ASGI)."""

HIGH_WATER = 64 * 1024
"""Request body bytes buffered before the connection stops reading the socket (flow control:
the client is held back by TCP until the app takes what is buffered)."""

_STATUS_LINES: dict[int, bytes] = {
    int(status): b"HTTP/1.1 %d %s\r\n" % (status, status.phrase.encode()) for status in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNKED_END = b"0\r\n\r\n"


def status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


class ClientGone(OSError):
    """Sending to a client that has closed its connection (ASGI 2.4: ``send`` raises an
    ``OSError`` then, so a streaming response stops making what nobody will read)."""


class _Date:
    """The ``date`` header line, made again once a second (not per answer)."""

    second = -1
    line = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second = second
            cls.line = b"date: " + formatdate(second, usegmt=True).encode() + b"\r\n"
        return cls.line


def head_lines(status: int, headers: Any, *, close: bool, security: bool) -> list[bytes]:
    """A response head up to (not including) its blank line: status, date, ``headers``, the
    security headers when ``security`` (answers made outside the app), ``connection: close``
    when ``close``."""
    parts = [status_line(status), _Date.now()]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if security:
        parts.append(SECURITY_LINES)
    if close:
        parts.append(b"connection: close\r\n")
    return parts


class Exchange:
    """One request on a ``Connection``: its scope, its body as it arrives, its answer."""

    __slots__ = (
        "_head",
        "_is_head",
        "_length_left",
        "body",
        "chunked",
        "conn",
        "disconnected",
        "expect_100",
        "keep_alive",
        "message_event",
        "more_body",
        "received",
        "response_complete",
        "response_started",
        "scope",
        "whole_body_given",
    )

    def __init__(
        self, conn: Connection, scope: dict[str, Any], *, keep_alive: bool, expect_100: bool
    ) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100 = expect_100  # a 100 Continue is owed once the app reads the body
        self.body = bytearray()
        self.received = 0  # body bytes so far
        self.more_body = True  # the request's body has not ended yet
        self.whole_body_given = False  # receive() has handed out the last body message
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.chunked = False
        self.message_event = asyncio.Event()
        self._head: list[bytes] | None = None  # a started answer's head, not yet written
        self._is_head = scope["method"] == "HEAD"
        self._length_left: int | None = None

    # ----- the request's body, fed by the connection -------------------------------------

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        self.body += chunk
        self.message_event.set()

    def end(self) -> None:
        self.more_body = False
        self.message_event.set()

    def gone(self) -> None:
        """The client closed the connection."""
        self.disconnected = True
        self.message_event.set()

    # ----- ASGI ----------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self.expect_100 and not self.disconnected and not self.response_started:
            self.expect_100 = False
            conn.write(_CONTINUE)
        if not self.disconnected and not self.response_complete:
            if self.whole_body_given:
                await self._wait()  # nothing more will come but the end of the exchange
            elif not self.body and self.more_body:
                conn.wants_body(self)
                await self._wait()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body.clear()
        if not self.more_body:
            self.whole_body_given = True
        else:
            conn.wants_body(self)  # the buffer was drained: reading may resume
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def _wait(self) -> None:
        self.message_event.clear()
        await self.message_event.wait()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("the answer has already started")
            self.response_started = True
            self.expect_100 = False
            self._start(message["status"], message.get("headers", ()))
        elif kind == "http.response.body":
            if not self.response_started:
                raise RuntimeError("an answer's body before its start")
            if self.response_complete:
                raise RuntimeError("the answer is already complete")
            await self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _start(self, status: int, headers: Any) -> None:
        length: int | None = None
        chunked = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding" and value.lower() == b"chunked":
                chunked = True
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
        if self.more_body:  # answered before its body was read: drained, or closed
            self.keep_alive = self.keep_alive and self.conn.can_drain(self)
        self._length_left = length
        self.chunked = chunked
        self._head = head_lines(status, headers, close=not self.keep_alive, security=False)
        if status in (204, 304) or status < 200:
            self._length_left = 0

    async def _body(self, body: bytes, more: bool) -> None:
        conn = self.conn
        head = self._head
        if head is not None:  # the first body message: decide the framing, write with the head
            self._head = None
            if self._length_left is None and not self.chunked:
                if more:
                    self.chunked = True
                    head.append(b"transfer-encoding: chunked\r\n")
                else:
                    self._length_left = len(body)
                    head.append(b"content-length: %d\r\n" % len(body))
            head.append(b"\r\n")
            out = b"".join(head)
        else:
            out = b""
        if self.disconnected:
            raise ClientGone("the client closed the connection")
        if self._is_head or (self._length_left == 0 and not self.chunked):
            payload = b""
        elif self.chunked:
            payload = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                payload += _CHUNKED_END
        else:
            payload = body
        if out or payload:
            conn.write(out + payload if out else payload)
        if not more:
            self.complete()
        elif conn.write_paused:
            await conn.drained()

    def write_whole(self, status: int, headers: Any, body: bytes) -> None:
        """A complete answer (made outside the app: security headers added), head and body in
        one write."""
        self.response_started = True
        self.expect_100 = False
        if self.more_body:
            self.keep_alive = self.keep_alive and self.conn.can_drain(self)
        if self.disconnected:
            return
        parts = head_lines(status, headers, close=not self.keep_alive, security=True)
        if not self._is_head:
            parts += (b"\r\n", body)
        else:
            parts.append(b"\r\n")
        self.conn.write(b"".join(parts))
        self.complete()

    def start_stream(self, headers: Any) -> None:
        """A 200 whose body follows chunk by chunk (``write_chunk``, then ``end_stream``)."""
        self.response_started = True
        self.expect_100 = False
        if self.more_body:
            self.keep_alive = self.keep_alive and self.conn.can_drain(self)
        self.chunked = True
        if self.disconnected:
            return
        parts = head_lines(200, headers, close=not self.keep_alive, security=True)
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        self.conn.write(b"".join(parts))

    def write_chunk(self, chunk: bytes) -> None:
        if not self.disconnected and chunk:
            self.conn.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")

    def end_stream(self) -> None:
        if not self.disconnected:
            self.conn.write(_CHUNKED_END)
        self.complete()

    def complete(self) -> None:
        """The answer is whole: the connection closes or arms keep-alive, and the next
        pipelined request starts."""
        if self.response_complete:
            return
        self.response_complete = True
        self.message_event.set()
        self.conn.answered(self)

    # ----- running an answer ------------------------------------------------------------

    async def run_app(self, app: Any) -> None:
        """Answer with the ASGI ``app``; a failure before the answer starts is a 500."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            if self.disconnected and not cancelled:
                return  # the client left: what the app made of that is nobody's answer
            if not cancelled:
                log.exception("the gateway failed answering %s", self.scope["path"])
            self._fail()
            if cancelled:
                raise
        else:
            if not self.response_complete:
                log.error("the app ended without a whole answer to %s", self.scope["path"])
                self._fail()

    def _fail(self) -> None:
        if not self.response_started:
            error = OpenAIError(500, "the gateway failed answering; see its log").response()
            self.write_whole(500, error.raw_headers, bytes(error.body))
        elif not self.response_complete:
            self.conn.transport.close()  # half an answer: the client must not take it whole

    async def answer_busy(self, limit: int) -> None:
        """The 503 of a gateway answering ``limit`` requests (``--limit-concurrency``)."""
        error = OpenAIError(
            503,
            f"the gateway is answering {limit} requests, its limit (--limit-concurrency); "
            "retry shortly",
            code="concurrency_limit",
            headers={"Retry-After": "1", "Connection": "close"},
        )
        self.keep_alive = False
        response = error.response()
        self.write_whole(503, response.raw_headers, bytes(response.body))
