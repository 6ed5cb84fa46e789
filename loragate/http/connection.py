"""One HTTP/1.1 connection to an upstream: the one protocol class that reads every answer.

It carries one exchange at a time, kept alive between them by ``pool`` or closed after one
by ``oneshot``. httptools' C parser reads the answers; interim (1xx) answers are skipped, and
a body is delimited by its Content-Length, by chunked encoding or by the connection's end.

An exchange may carry a silence limit: past that many seconds without a byte of the answer
(its head, or the next piece of its body) the connection is cut and the one waiting gets
``UpstreamSilent``. A hung engine or upstream would otherwise hold its client, its adapter
lease and a socket for ever; cutting the connection is also how vLLM learns to stop. A body
read whole (``read_all``) may also have a deadline, however steadily it trickles
(``UpstreamOverdue``), and a size past which it is refused (``UpstreamTooLarge``): nothing an
upstream sends makes the gateway wait or hold memory without bound.

A connection cut (``abort``) drops whatever it had buffered at once: the connection and its
parser refer to each other, so the connection itself waits for the garbage collector, but
never with an answer's bytes in it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import ssl
import sys
import time
from collections.abc import Callable
from typing import cast

import httptools

from loragate.http.wire import Origin

# Past this much unread stream data, stop reading the upstream socket (TCP back-pressure).
HIGH_WATER = 256 * 1024


class UpstreamBroken(Exception):
    """The upstream connection failed or sent something that is not HTTP/1.1."""


class UpstreamSilent(UpstreamBroken):
    """The upstream sent nothing for the exchange's silence limit; the connection was cut.

    Not a sign that the upstream is gone (it accepted the request), so never a reason to
    send the request again.
    """

    def __init__(self, seconds: float, message: str | None = None) -> None:
        super().__init__(message or f"the upstream sent nothing for {seconds:g} s")
        self.seconds = seconds


class UpstreamOverdue(UpstreamSilent):
    """A body read whole had not arrived whole ``seconds`` after the request was sent, however
    steadily it came; the connection was cut."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds, f"the upstream's answer took longer than {seconds:g} s")


class UpstreamTooLarge(UpstreamBroken):
    """The upstream sent more than the reader takes in one piece (``limit`` bytes): a body
    read whole, or one event of a relayed stream. The connection was cut."""

    def __init__(self, limit: int, what: str = "answer") -> None:
        super().__init__(f"the upstream's {what} is larger than {limit} bytes")
        self.limit = limit


class UpstreamConnection(asyncio.Protocol):
    """One HTTP/1.1 connection carrying one exchange at a time.

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
        self._silence_limit = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._last_byte = 0.0
        self._sent_at = 0.0
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
        self._high_water = HIGH_WATER
        self._paused = False
        self._until_close = True
        self._keep_alive = False
        self._deadline = math.inf  # when a body read whole must have arrived (read_all)
        self._deadline_seconds = 0.0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last_byte = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBroken(f"not an HTTP/1.1 answer: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self.error is not None:  # cut for a reason already recorded (UpstreamSilent)
            self._wake()
            return
        if self.head_done and not self.complete and self._until_close and exc is None:
            self.complete = True  # a body delimited by the connection's end
            self._wake()
            return
        if not self.complete:
            self._fail(
                UpstreamBroken(f"the connection closed before the answer ended ({exc or 'EOF'})")
            )

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
        if self.closed:  # cut while the parser still had bytes of this read to go
            return
        if self._sink is not None:
            self._sink(body)
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > self._high_water:
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
        self._stop_timer()
        self._wake()

    # the exchange, seen from the coroutine that owns it

    def send(self, data: bytes, silence_limit: float | None = None) -> None:
        """Start an exchange; with ``silence_limit``, it fails with ``UpstreamSilent`` once
        the upstream has sent nothing for that many seconds (while the answer is not held
        back by ``hold``)."""
        assert self.transport is not None
        self._reset()
        self._sink = None
        self.exchanges += 1
        self._stop_timer()
        self._silence_limit = silence_limit or 0.0
        self._sent_at = self._last_byte = time.monotonic()
        if silence_limit:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(silence_limit, self._check_time)
        self.transport.write(data)

    def _check_time(self) -> None:
        """One timer per exchange, re-armed for what is left (of the silence limit, or of
        ``read_all``'s deadline, whichever ends first) rather than reset per chunk."""
        self._timer = None
        if self.complete or self.closed:
            return
        now = time.monotonic()
        if self._paused:  # the client is not reading: not the upstream's silence
            self._last_byte = now
        left = self._deadline - now
        if self._silence_limit:
            left = min(left, self._last_byte + self._silence_limit - now)
        if left > 0:
            if left != math.inf:
                self._timer = asyncio.get_running_loop().call_later(left, self._check_time)
            return
        if now >= self._deadline:
            self.give_up(UpstreamOverdue(self._deadline_seconds))
        else:
            self.give_up(UpstreamSilent(self._silence_limit))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def head(self) -> None:
        while not self.head_done:
            await self._wait()

    async def read_all(self, limit: int = sys.maxsize, within: float | None = None) -> bytes:
        """The whole body. Past ``limit`` bytes the connection is cut and ``UpstreamTooLarge``
        raised; short of it the socket is read on (no back-pressure: the body is wanted whole,
        and pausing would wait for it forever). With ``within``, the body must have arrived
        whole that many seconds after the request was sent, or the connection is cut and
        ``UpstreamOverdue`` raised."""
        self._high_water = limit
        self.release()
        if within and not self.complete:
            self._deadline_seconds = within
            self._deadline = self._sent_at + within
            self._stop_timer()
            self._check_time()  # re-armed for whichever ends first (or given up at once)
        while not self.complete and self._buffered <= limit:
            await self._wait()
        if self._buffered > limit:
            too_large = UpstreamTooLarge(limit)
            self.give_up(too_large)
            raise too_large
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

    def close(self) -> None:
        """Close once the answer is read: gracefully (a FIN, not a reset)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection (a reset), dropping what was buffered of the answer."""
        self.closed = True
        self._body.clear()
        self._buffered = 0
        if self.transport is not None:
            self.transport.abort()

    def give_up(self, error: UpstreamBroken) -> None:
        """Cut the connection for ``error``, which the one waiting on it gets."""
        self._fail(error)
        self.abort()

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


@functools.cache
def tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # tens of milliseconds to build: once


async def connect(origin: Origin) -> UpstreamConnection:
    """A new connection to ``origin`` (its Unix socket, if it names one); OSError if none."""
    scheme, host, port, uds = origin
    loop = asyncio.get_running_loop()
    if uds:
        _, unix_conn = await loop.create_unix_connection(UpstreamConnection, uds)
        return unix_conn
    tls = tls_context() if scheme == "https" else None
    _, conn = await loop.create_connection(UpstreamConnection, host, port, ssl=tls)
    return conn
