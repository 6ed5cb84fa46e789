"""The upstream client: keep-alive reuse, failures and their error semantics, stream relaying."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from starlette.responses import Response

from loragate.gateway.errors import OpenAIError
from loragate.gateway.proxy import (
    ProxyClient,
    RelayResponse,
    UpstreamUnreachable,
)
from loragate.http import oneshot
from loragate.serving.engine_names import Rename

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body, or None when the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length)


def json_response(body: bytes, status: int = 200) -> bytes:
    return (
        b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % (status, len(body))
        + body
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
ANSWER = b'{"model":"engine@1","choices":[]}'


class Upstream:
    """A scripted HTTP/1.1 server: ``handler(reader, writer, n)`` runs for the n-th connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Upstream]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        async with server:
            yield self


async def answer_forever(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
) -> None:
    while await read_request(reader) is not None:
        writer.write(json_response(ANSWER))
        await writer.drain()


class Done:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


async def forward(client: ProxyClient, url: str, done: Done, stream: bool = False) -> Response:
    return await client.forward(
        url,
        b'{"model":"engine@1"}',
        {"Content-Type": "application/json", "X-Request-Id": "r1"},
        stream=stream,
        rename=Rename.of("engine@1", "public"),
        on_done=done,
        response_headers={"X-Request-ID": "r1"},
    )


async def relay(
    response: Response, disconnect_after_first_event: bool = False
) -> list[dict[str, Any]]:
    """Run a streamed response as uvicorn would; returns the messages it sent."""
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if disconnect_after_first_event and message.get("body"):
            gone.set()

    await response({"type": "http"}, receive, send)
    return sent


def body_of(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")


async def test_sequential_requests_share_one_keep_alive_connection() -> None:
    client, done = ProxyClient(), Done()
    async with Upstream(answer_forever).running() as upstream:
        for _ in range(5):
            response = await forward(client, upstream.url, done)
            assert response.status_code == 200
            assert response.body == b'{"model":"public","choices":[]}'
            assert response.headers["x-request-id"] == "r1"
        await client.aclose()
    assert upstream.connections == 1
    assert done.calls == 5


async def test_an_answer_past_the_stream_high_water_is_read_whole_on_a_kept_connection() -> None:
    """A non-streamed answer of megabytes (embeddings of a batch) is not paused for a reader
    that wants it whole, and the connection it came on serves the next request."""
    big = b'{"model":"engine@1","data":"' + b"x" * 3_000_000 + b'"}'

    async def answer_big(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        while await read_request(reader) is not None:
            writer.write(json_response(big))
            await writer.drain()

    client, done = ProxyClient(), Done()
    async with Upstream(answer_big).running() as upstream:
        for _ in range(2):
            response = await asyncio.wait_for(forward(client, upstream.url, done), 10)
            assert response.body == big.replace(b"engine@1", b"public", 1)
        await client.aclose()
    assert upstream.connections == 1


async def test_an_unreachable_upstream_is_reported_as_such_and_released() -> None:
    upstream = Upstream(answer_forever)
    async with upstream.running():
        url = upstream.url
    client, done = ProxyClient(), Done()
    with pytest.raises(UpstreamUnreachable) as caught:
        await forward(client, url, done)
    assert caught.value.status == 503
    assert not caught.value.maybe_delivered
    assert caught.value.headers["X-Request-ID"] == "r1"
    assert done.calls == 1


async def test_a_keep_alive_connection_closed_under_us_is_retried_once_on_a_fresh_one() -> None:
    async def close_on_second_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        if n == 1:
            await read_request(reader)
            writer.write(json_response(ANSWER))
            await writer.drain()
            await read_request(reader)  # the reused connection: gone without an answer
            return
        await answer_forever(reader, writer, n)

    client, done = ProxyClient(), Done()
    async with Upstream(close_on_second_request).running() as upstream:
        assert (await forward(client, upstream.url, done)).status_code == 200
        assert (await forward(client, upstream.url, done)).status_code == 200
        await client.aclose()
    assert upstream.connections == 2
    assert done.calls == 2


async def test_a_kept_alive_connection_lost_with_the_upstream_may_have_delivered() -> None:
    """The upstream died holding a request: resendable, but flagged as possibly delivered."""
    listening: list[asyncio.Server] = []

    async def die_on_second_request(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await read_request(reader)
        writer.write(json_response(ANSWER))
        await writer.drain()
        await read_request(reader)  # received, then the upstream dies: no one listens any more
        listening[0].close()
        writer.close()

    server = await asyncio.start_server(die_on_second_request, "127.0.0.1", 0)
    listening.append(server)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    client, done = ProxyClient(), Done()
    assert (await forward(client, url, done)).status_code == 200
    with pytest.raises(UpstreamUnreachable) as caught:
        await forward(client, url, done)
    assert caught.value.maybe_delivered
    assert done.calls == 2
    await client.aclose()


async def test_a_new_connection_cut_before_any_answer_may_have_delivered() -> None:
    """A dying engine's listener takes the connection, then it goes without a byte of answer:
    resendable (the engine is going away), flagged as possibly delivered."""

    async def take_then_die(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(reader)
        writer.transport.abort()

    client, done = ProxyClient(), Done()
    async with Upstream(take_then_die).running() as upstream:
        with pytest.raises(UpstreamUnreachable) as caught:
            await forward(client, upstream.url, done)
        await client.aclose()
    assert caught.value.maybe_delivered and caught.value.status == 503
    assert done.calls == 1


async def test_an_answer_cut_short_is_a_503_and_not_resent() -> None:
    async def half_an_answer(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(reader)
        writer.write(json_response(ANSWER)[:-10])
        await writer.drain()

    client, done = ProxyClient(), Done()
    async with Upstream(half_an_answer).running() as upstream:
        with pytest.raises(OpenAIError) as caught:
            await forward(client, upstream.url, done)
    assert not isinstance(caught.value, UpstreamUnreachable)
    assert caught.value.status == 503 and caught.value.code == "engine_unavailable"
    assert upstream.connections == 1
    assert done.calls == 1


EVENT = b'data: {"model":"engine@1","choices":[{"delta":{"content":"hi"}}]}\n\n'


async def split_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    """One event cut in two across chunks, then another and the end in one chunk."""
    await read_request(reader)
    writer.write(SSE_HEAD + chunk(EVENT[:20]))
    await writer.drain()
    await asyncio.sleep(0.01)
    writer.write(chunk(EVENT[20:] + EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    await read_request(reader)


async def die_mid_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
) -> None:
    await read_request(reader)
    writer.write(SSE_HEAD + chunk(b'data: {"model":"engine@1"}\n\n'))
    await writer.drain()
    writer.transport.abort()


async def piped(response: Response) -> list[bytes]:
    """Run a streamed response as the hot-route protocol does: ``pipe``, then ``close``."""
    assert isinstance(response, RelayResponse)
    written: list[bytes] = []
    try:
        await response.pipe(written.append)
    finally:
        response.close()
    return written


async def test_streams_are_relayed_event_by_event_with_the_model_renamed_across_chunks() -> None:
    client, done = ProxyClient(), Done()
    async with Upstream(split_events).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
        assert done.calls == 0  # held until the stream ends
        messages = await relay(response)
        await client.aclose()
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert body_of(messages) == (EVENT * 2 + b"data: [DONE]\n\n").replace(b"engine@1", b"public")
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert done.calls == 1


async def test_piped_streams_pass_whole_events_renamed_and_keep_the_connection() -> None:
    client, done = ProxyClient(), Done()
    async with Upstream(split_events).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
        written = await piped(response)
        idle = sum(len(stack) for stack in client._pool._idle.values())
        await client.aclose()
    renamed = EVENT.replace(b"engine@1", b"public")
    # One write per upstream chunk, each ending where an event ends (never half an event).
    assert written == [renamed * 2, b"data: [DONE]\n\n"]
    assert done.calls == 1
    assert idle == 1  # the finished connection went back to the pool


async def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    for run in (relay, piped):
        client, done = ProxyClient(), Done()
        async with Upstream(die_mid_stream).running() as upstream:
            response = await forward(client, upstream.url, done, stream=True)
            sent = await run(response)
        body = b"".join(sent) if run is piped else body_of(sent)  # type: ignore[arg-type]
        first, error, end = body.split(b"\n\n", 2)
        assert first == b'data: {"model":"public"}'
        assert b'"code":"engine_stream_interrupted"' in error
        assert end == b"data: [DONE]\n\n"
        assert done.calls == 1


async def test_a_client_leaving_mid_stream_cuts_the_upstream_connection() -> None:
    upstream_saw_eof = asyncio.Event()

    async def endless_stream(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: {}\n\n"))
        await writer.drain()
        await reader.read()  # until the gateway hangs up
        upstream_saw_eof.set()

    client, done = ProxyClient(), Done()
    async with Upstream(endless_stream).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
        await asyncio.wait_for(relay(response, disconnect_after_first_event=True), 5)
        await asyncio.wait_for(upstream_saw_eof.wait(), 5)
    assert done.calls == 1


async def test_an_error_answer_to_a_stream_request_is_a_plain_response_with_the_name_hidden() -> (
    None
):
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_response(b'{"error":{"message":"engine@1 cannot do that"}}', status=400))
        await writer.drain()

    client, done = ProxyClient(), Done()
    async with Upstream(refuse).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
    assert response.status_code == 400
    assert response.body == b'{"error":{"message":"public cannot do that"}}'
    assert done.calls == 1


async def test_an_interim_answer_before_the_real_one_is_skipped() -> None:
    """A 103 Early Hints (or 100 Continue) first: the client gets the final answer, once."""

    async def hints_first(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            writer.write(json_response(ANSWER))
            await writer.drain()

    client, done = ProxyClient(), Done()
    async with Upstream(hints_first).running() as upstream:
        for _ in range(2):  # and the kept-alive connection is still in step for the next
            response = await forward(client, upstream.url, done)
            assert response.status_code == 200
            assert response.body == b'{"model":"public","choices":[]}'
        await client.aclose()
    assert upstream.connections == 1


@pytest.mark.parametrize("header", [{"X-A": "a\r\nX-Smuggled: 1"}, {"X-A\nB": "b"}])
async def test_a_header_with_a_line_break_is_refused_by_both_clients(
    header: dict[str, str],
) -> None:
    client, seen = ProxyClient(), []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        seen.append(await reader.read(65536))

    async with Upstream(record).running() as upstream:
        with pytest.raises(OpenAIError, match="ValueError"):
            await client.forward(
                upstream.url, b"{}", header, stream=False, rename=None,
                on_done=Done(), response_headers={},
            )  # fmt: skip
        await client.aclose()
    assert seen in ([], [b""])  # nothing of the request was sent
    with pytest.raises(ValueError, match="line break"):
        await oneshot.request("GET", "http://127.0.0.1:9/x", timeout=1, headers=header)


# ----- work nobody waits for: the caller leaves, or the upstream goes silent ---------------------


def answer_first_then(stage: str, hung_up: asyncio.Event) -> Handler:
    """Answers the first request; on the second (on the same kept-alive connection) sends
    ``stage`` of an answer ("nothing" or "half": the head and part of the body), then waits
    for the gateway to hang up and says so."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(json_response(ANSWER))
        await writer.drain()
        await read_request(reader)
        if stage == "half":
            writer.write(json_response(ANSWER)[:-10])
            await writer.drain()
        await reader.read()  # b"" once the gateway closes its end
        hung_up.set()

    return handler


@pytest.mark.parametrize("stage", ["nothing", "half"])
async def test_a_forward_cancelled_midway_cuts_its_kept_alive_connection_and_ends_the_lease(
    stage: str,
) -> None:
    """The client left while the engine was still generating (no head yet, or the body
    half-read): the connection is cut, not pooled, which is what makes the engine abort,
    and ``on_done`` (the adapter lease) runs once."""
    hung_up = asyncio.Event()
    client, done = ProxyClient(), Done()
    async with Upstream(answer_first_then(stage, hung_up)).running() as upstream:
        assert (await forward(client, upstream.url, done)).status_code == 200
        waiting = asyncio.ensure_future(forward(client, upstream.url, done))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.wait_for(hung_up.wait(), 5)
        assert done.calls == 2
        # And the next request gets a fresh connection and a whole answer.
        response = await forward(client, upstream.url, done)
        assert response.body == b'{"model":"public","choices":[]}'
        await client.aclose()
    assert upstream.connections == 2


def silent_after(first: bytes, hung_up: asyncio.Event) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(first)
        await writer.drain()
        await reader.read()
        hung_up.set()

    return handler


@pytest.mark.parametrize(
    "first", [b"", json_response(ANSWER)[:-10]], ids=["no-head", "half-a-body"]
)
async def test_an_upstream_silent_past_the_limit_is_a_504_and_cut(first: bytes) -> None:
    hung_up = asyncio.Event()
    client, done = ProxyClient(silence_limit=0.5), Done()
    async with Upstream(silent_after(first, hung_up)).running() as upstream:
        started = asyncio.get_running_loop().time()
        with pytest.raises(OpenAIError) as caught:
            await asyncio.wait_for(forward(client, upstream.url, done), 5)
        took = asyncio.get_running_loop().time() - started
        await asyncio.wait_for(hung_up.wait(), 5)
    assert caught.value.status == 504 and caught.value.code == "engine_timeout"
    assert not isinstance(caught.value, UpstreamUnreachable)  # never sent again
    assert caught.value.headers["X-Request-ID"] == "r1"
    assert 0.45 < took < 1.5
    assert upstream.connections == 1 and done.calls == 1


@pytest.mark.parametrize("run", [relay, piped], ids=["asgi", "piped"])
async def test_a_stream_silent_past_the_limit_ends_with_a_timeout_event(run: Any) -> None:
    hung_up = asyncio.Event()
    client, done = ProxyClient(silence_limit=0.5), Done()
    first = SSE_HEAD + chunk(b'data: {"model":"engine@1"}\n\n')
    async with Upstream(silent_after(first, hung_up)).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
        sent = await asyncio.wait_for(run(response), 5)
        await asyncio.wait_for(hung_up.wait(), 5)
    body = b"".join(sent) if run is piped else body_of(sent)
    first_event, error, end = body.split(b"\n\n", 2)
    assert first_event == b'data: {"model":"public"}'
    assert b'"code":"engine_timeout"' in error
    assert end == b"data: [DONE]\n\n"
    assert done.calls == 1


async def test_a_slow_but_steady_stream_is_not_cut_by_the_silence_limit() -> None:
    """The limit is on silence, not on the whole answer: 8 events 0.2 s apart outlast a
    0.5 s limit and arrive whole."""

    async def steady(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        for _ in range(8):
            await asyncio.sleep(0.2)
            writer.write(chunk(b'data: {"model":"engine@1"}\n\n'))
            await writer.drain()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    client, done = ProxyClient(silence_limit=0.5), Done()
    async with Upstream(steady).running() as upstream:
        response = await forward(client, upstream.url, done, stream=True)
        body = b"".join(await asyncio.wait_for(piped(response), 10))
        await client.aclose()
    assert body.count(b'data: {"model":"public"}') == 8 and body.endswith(b"data: [DONE]\n\n")
