"""The one-shot client: one request per connection against real local sockets, answers good
and bad."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from loragate.http import oneshot

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        await srv.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if line:
            name, _, value = line.partition(": ")
            headers[name.lower()] = value
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return head[0], headers, body


async def test_a_get_returns_status_and_body_and_sends_the_headers() -> None:
    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 19\r\n\r\n")
        writer.write(b'{"status":"starting"}'[:19])
        await writer.drain()
        writer.close()

    async with server(answer) as url:
        response = await oneshot.request(
            "GET", url + "/health?deep=1", timeout=5, headers={"Authorization": "Bearer k"}
        )
    assert response.status == 503
    assert response.body == b'{"status":"starting"}'[:19]
    [(line, headers, body)] = seen
    assert line == "GET /health?deep=1 HTTP/1.1"
    assert headers["host"] == url.removeprefix("http://")
    assert headers["connection"] == "close"
    assert headers["authorization"] == "Bearer k"
    assert body == b""


async def test_a_post_sends_json_and_a_chunked_answer_is_read_whole() -> None:
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, headers, body = await read_request(reader)
        assert headers["content-type"] == "application/json"
        seen.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b'{"ok":', b"true}"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with server(answer) as url:
        response = await oneshot.request(
            "POST", url + "/v1/completions", timeout=5, json={"prompt": "ping"}
        )
    assert response.status == 200 and response.json() == {"ok": True}
    assert json.loads(seen[0]) == {"prompt": "ping"}


async def test_a_port_nobody_listens_on_is_not_reachable() -> None:
    async with server(read_request) as url:  # type: ignore[arg-type]
        pass  # closed: the port now refuses
    with pytest.raises(oneshot.PlainHTTPError, match="not reachable"):
        await oneshot.request("GET", url + "/health", timeout=5)


def silent_until_dropped(dropped: asyncio.Event) -> Handler:
    """A server that never answers and sets ``dropped`` once the client's socket is gone."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read()
        dropped.set()

    return silent


async def test_a_server_that_never_answers_times_out_and_the_socket_is_dropped() -> None:
    dropped = asyncio.Event()
    async with server(silent_until_dropped(dropped)) as url:
        started = time.monotonic()
        with pytest.raises(oneshot.PlainHTTPError, match=r"within 0\.2 s"):
            await oneshot.request("GET", url + "/health", timeout=0.2)
        assert time.monotonic() - started < 1.5
        await asyncio.wait_for(dropped.wait(), 1)  # not left open until the server gives up


async def test_a_cancelled_request_drops_its_socket() -> None:
    dropped = asyncio.Event()
    async with server(silent_until_dropped(dropped)) as url:
        task = asyncio.create_task(oneshot.request("GET", url + "/health", timeout=30))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(dropped.wait(), 1)


async def test_a_body_ended_by_the_close_and_an_interim_answer_are_read_right() -> None:
    async def old_style(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"data":[]}')
        await writer.drain()

    async with server(old_style) as url:
        response = await oneshot.request("GET", url + "/v1/models", timeout=5)
    assert response.status == 200 and response.json() == {"data": []}


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", "closed before the answer ended"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not an HTTP/1.1 answer"),
    ],
)
async def test_a_cut_or_foreign_answer_is_an_error(answer: bytes, error: str) -> None:
    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with server(reply) as url:
        with pytest.raises(oneshot.PlainHTTPError, match=error):
            await oneshot.request("GET", url + "/health", timeout=5)


async def test_an_answer_past_the_size_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oneshot, "MAX_BODY_BYTES", 1000)

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        await writer.drain()

    async with server(huge) as url:
        with pytest.raises(oneshot.PlainHTTPError, match="larger than 1000 bytes"):
            await oneshot.request("GET", url + "/v1/models", timeout=5)


async def test_only_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="not an http"):
        await oneshot.request("GET", "ftp://127.0.0.1/x", timeout=1)
