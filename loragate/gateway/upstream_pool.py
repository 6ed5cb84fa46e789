"""The upstream side of the proxy: keep-alive HTTP/1.1 connections and their pool.

Each connection carries one exchange at a time; httptools' C parser reads the answers. Idle
connections go back to a per-origin stack and are dropped when the upstream closes them or
after the pool's idle timeout. ``proxy.ProxyClient`` drives them.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import cast
from urllib.parse import urlsplit

import httptools

from loragate.plain_http import header_lines

# Past this much unread stream data, stop reading the upstream socket (TCP back-pressure).
HIGH_WATER = 256 * 1024


class UpstreamBroken(Exception):
    """The upstream connection failed or sent something that is not HTTP/1.1."""


# ----- one upstream connection ----------------------------------------------------------------


class UpstreamConnection(asyncio.Protocol):
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
        if self._buffered > HIGH_WATER:
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
class Target:
    origin: Origin
    request_line: bytes  # b"POST /v1/... HTTP/1.1\r\nHost: ...\r\n"


@lru_cache(maxsize=64)
def target(url: str, method: str = "POST", uds: str | None = None) -> Target:
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
    return Target((parts.scheme, parts.hostname, port, uds or ""), line)


def request_bytes(target: Target, headers: dict[str, str], body: bytes) -> bytes:
    length = b"Content-Length: %d\r\n" % len(body)
    return b"".join((target.request_line, length, header_lines(headers), b"\r\n", body))


class Pool:
    def __init__(self, connect_timeout: float, idle_timeout: float, max_idle: int) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def take_idle(self, origin: Origin) -> UpstreamConnection | None:
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

    async def connect(self, origin: Origin) -> UpstreamConnection:
        scheme, host, port, uds = origin
        loop = asyncio.get_running_loop()
        if uds:
            _, unix_conn = await asyncio.wait_for(
                loop.create_unix_connection(UpstreamConnection, uds), self.connect_timeout
            )
            return unix_conn
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        _, conn = await asyncio.wait_for(
            loop.create_connection(UpstreamConnection, host, port, ssl=tls), self.connect_timeout
        )
        return conn

    def give_back(self, origin: Origin, conn: UpstreamConnection) -> None:
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
