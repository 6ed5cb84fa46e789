"""One HTTP/1.1 exchange on its own connection, without a client library.

For what the gateway asks every few seconds for its whole life: the supervisor's health probe
and the upstream backend's model list. With httpx each of these took several milliseconds of
CPU on the event loop (a resolver thread, cancel scopes, cookie handling, and a new connection
each time, as the probe interval outlasts the server's keep-alive), in the gaps between the
requests it delayed. Here it is one socket, httptools' parser and ``Connection: close``:
measured on the 2-core box, an idle ``gateway serve`` went from 3.3% to 1.6% of a core, and
an idle ``--upstream-url`` one from 2.4% to 1.5%.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

MAX_BODY_BYTES = 16 * 1024 * 1024


class PlainHTTPError(Exception):
    """The server was not reached, did not answer in time, or did not answer HTTP/1.1."""


@dataclass(frozen=True)
class PlainResponse:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return orjson.loads(self.body)


class _Exchange(asyncio.Protocol):
    def __init__(self, request: bytes) -> None:
        self._request = request
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self._size = 0
        self._head_done = False
        self._until_close = True  # no Content-Length and not chunked: the body ends at EOF
        self.done: asyncio.Future[PlainResponse] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self._request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(PlainHTTPError(f"not an HTTP/1.1 answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self._head_done and self._until_close:
            self._finish()
            return
        self._fail(
            PlainHTTPError(f"the connection closed before the answer ended ({exc or 'EOF'})")
        )

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._until_close = False

    def on_headers_complete(self) -> None:
        self._head_done = True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY_BYTES:
            self._fail(PlainHTTPError(f"the answer is larger than {MAX_BODY_BYTES} bytes"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self._parser.get_status_code() < 200:  # 100 Continue, 103 Early Hints: more
            self._body.clear()
            self._head_done, self._until_close = False, True
            return
        self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            status = self._parser.get_status_code()
            self.done.set_result(PlainResponse(status, b"".join(self._body)))
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: PlainHTTPError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


def header_lines(headers: dict[str, str]) -> bytes:
    """``Name: value`` lines (CRLF-ended) for each header (of the proxy's requests too); a line break in
    a name or value is refused: it would end the head and smuggle what follows."""
    lines = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    return b"".join(lines)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # tens of milliseconds to build: once


async def request(
    method: str,
    url: str,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
    json: Any = None,
    uds: str | None = None,
) -> PlainResponse:
    """Send one request to an ``http://`` or ``https://`` URL; any answer status is returned.

    With ``uds``, connect to that Unix socket instead of the URL's host and port (the URL
    still gives the path and the Host header). Raises ``PlainHTTPError`` when nothing answers
    within ``timeout`` seconds, in full.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    if tls and uds is not None:
        raise ValueError("a Unix socket carries plain http:// only")
    host = parts.hostname
    port = parts.port or (443 if tls else 80)  # a bad port raises ValueError here
    authority = parts.netloc.rpartition("@")[2]  # no credentials in the Host header
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    body = b"" if json is None else orjson.dumps(json)
    first = f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n"
    fields = dict(headers or {})
    if json is not None:
        fields |= {"Content-Type": "application/json", "Content-Length": str(len(body))}
    head = first.encode("latin-1") + header_lines(fields) + b"\r\n"
    loop = asyncio.get_running_loop()
    exchange: _Exchange | None = None
    answered = False
    try:
        async with asyncio.timeout(timeout):
            if uds is not None:
                _, exchange = await loop.create_unix_connection(lambda: _Exchange(head + body), uds)
            else:
                _, exchange = await loop.create_connection(
                    lambda: _Exchange(head + body),
                    host,
                    port,
                    ssl=_tls_context() if tls else None,
                )
            response = await exchange.done
            answered = True
            return response
    except TimeoutError as exc:
        raise PlainHTTPError(f"no answer from {url} within {timeout:g} s") from exc
    except OSError as exc:  # ssl.SSLError included
        where = f"{url} (socket {uds})" if uds is not None else url
        raise PlainHTTPError(f"{where} is not reachable: {exc.strerror or exc}") from exc
    finally:
        # Timed out or cancelled (which cancels ``done`` too): drop the socket now, not when
        # the server closes it; a hung engine would otherwise cost a descriptor per probe.
        if exchange is not None and not answered and exchange.transport is not None:
            exchange.transport.abort()
