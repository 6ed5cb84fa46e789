"""One HTTP/1.1 exchange on its own connection, closed after it.

For what the gateway asks every few seconds for its whole life: the supervisor's health probe,
the engine's metrics, the upstream backend's model list, and the rare LoRA load and unload.
With httpx each of these took several milliseconds of CPU on the event loop (a resolver
thread, cancel scopes, cookie handling, and a new connection each time, as the probe interval
outlasts the server's keep-alive), in the gaps between the requests it delayed. Here it is one
socket, the pool's own connection class and ``Connection: close``: measured on the 2-core
box, an idle ``gateway serve`` went from 3.3% to 1.6% of a core, and an idle
``--upstream-url`` one from 2.4% to 1.5%.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from loragate.http.connection import UpstreamBroken, UpstreamConnection, connect
from loragate.http.wire import header_lines, target

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
    where = target(url, method, uds)  # ValueError for anything but an http(s) URL
    body = b"" if json is None else orjson.dumps(json)
    fields = dict(headers or {})
    if json is not None:
        fields |= {"Content-Type": "application/json", "Content-Length": str(len(body))}
    head = where.request_line + b"Connection: close\r\n" + header_lines(fields) + b"\r\n"
    conn: UpstreamConnection | None = None
    answered = False
    try:
        async with asyncio.timeout(timeout):
            conn = await connect(where.origin)
            conn.send(head + body)
            await conn.head()
            content = await conn.read_all(MAX_BODY_BYTES)
            answered = True
            return PlainResponse(conn.status, content)
    except TimeoutError as exc:
        raise PlainHTTPError(f"no answer from {url} within {timeout:g} s") from exc
    except UpstreamBroken as exc:
        raise PlainHTTPError(str(exc)) from exc
    except OSError as exc:  # ssl.SSLError included
        where_to = f"{url} (socket {uds})" if uds is not None else url
        raise PlainHTTPError(f"{where_to} is not reachable: {exc.strerror or exc}") from exc
    finally:
        # Timed out or cancelled: drop the socket now, not when the server closes it; a hung
        # engine would otherwise cost a descriptor per probe.
        if conn is not None and not answered:
            conn.abort()
        elif conn is not None:
            conn.close()
