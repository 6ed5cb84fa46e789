"""Hostile connections against ``gateway serve``'s HTTP entry (``server.connection``): real sockets
against the in-process gateway, as served (the hot protocol, or the guard alone with CORS on).

Idle sockets are closed by the header deadline and do not fill ``limit_concurrency``; headers
sent a byte at a time get a 408; a stalled body is closed, and a trickled one is cut by the body
deadline so it cannot hold a ``limit_concurrency`` slot; after an early 401 or 413 the
connection stays in step (the unread body dropped, or a close); a client that never reads its
stream is closed and its answer stopped being made; a huge header or too many headers get a 431
and cost the gateway no memory, pipelined or not; one address may be held to a number of
connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.responses import Response, StreamingResponse

from loragate.gateway.app import create_app
from tests.backend_double import RecordingBackend, serving, settings_for

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}


def gateway(tmp_path: Path, backend: Any = None, **values: Any) -> Any:
    return create_app(settings_for(tmp_path, **values), backend=backend or RecordingBackend())


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sent first is read)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response read from ``sock`` (the socket stays open)."""
    response = http.client.HTTPResponse(sock, method="GET")
    response.begin()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def raw_chat(body: bytes, length: int | None = None) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (len(body) if length is None else length)
    ) + body


@pytest.fixture(params=["hot path", "asgi (cors on)"])
def cors(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The guard's limits hold on both protocols ``gateway serve`` may run."""
    return {"cors_origins": ["https://app.example"]} if request.param != "hot path" else {}


# ----- idle and slow heads ------------------------------------------------------------------


def test_512_idle_sockets_leave_every_route_answering_and_are_closed_by_the_deadline(
    tmp_path: Path,
) -> None:
    backend = RecordingBackend()
    app = gateway(tmp_path, backend, header_timeout=1.5)  # limit_concurrency: the default 512
    with serving(app, as_served=True) as url:
        opened = time.monotonic()
        idle = [socket.create_connection(address(url)) for _ in range(512)]
        try:
            assert httpx.get(f"{url}/health/live", timeout=5).status_code == 200
            chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=5)
            assert chat.status_code == 200, chat.text
            assert all(closed_within(sock, opened + 1.5 + 3 - time.monotonic()) for sock in idle)
            assert time.monotonic() - opened > 1.2  # closed by the deadline, not at once
        finally:
            for sock in idle:
                sock.close()
    assert [path for path, _ in backend.forwarded] == ["/v1/chat/completions"]


def test_headers_sent_a_byte_a_second_get_a_408_within_the_header_deadline(
    tmp_path: Path, cors: dict[str, Any]
) -> None:
    app = gateway(tmp_path, header_timeout=2.0, **cors)
    with serving(app, as_served=True) as url, socket.create_connection(address(url)) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        received = b""
        while not received and time.monotonic() - started < 6:
            sock.sendall(b"a")  # one more header byte each second: never the end of the head
            sock.settimeout(1.0)
            try:
                received = sock.recv(65536)
            except TimeoutError:
                continue
        took = time.monotonic() - started
        assert received.startswith(b"HTTP/1.1 408 "), received
        body = orjson.loads(received.partition(b"\r\n\r\n")[2])
        assert body["error"]["code"] == "request_timeout"
        assert 1.8 < took < 4
        assert closed_within(sock, 4)


def test_a_kept_alive_connection_times_the_next_head_from_its_first_byte(tmp_path: Path) -> None:
    app = gateway(tmp_path, header_timeout=1.0)
    with serving(app, as_served=True) as url, socket.create_connection(address(url)) as sock:
        live = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"
        sock.sendall(live)
        assert answer(sock)[0] == 200
        time.sleep(1.5)  # past the header deadline counted from accept: still open (keep-alive)
        sock.sendall(live)
        assert answer(sock)[0] == 200
        started = time.monotonic()
        sock.sendall(b"GET /health/live HTTP/1.1\r\n")  # and then nothing
        sock.settimeout(3)
        received = sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 408 ")
        assert 0.8 < time.monotonic() - started < 2.5


# ----- bodies -------------------------------------------------------------------------------


def test_a_stalled_body_is_closed_and_a_slow_but_moving_one_is_served(
    tmp_path: Path, cors: dict[str, Any]
) -> None:
    backend = RecordingBackend()
    app = gateway(tmp_path, backend, body_timeout=1.0, **cors)
    body = orjson.dumps(CHAT)
    with serving(app, as_served=True) as url:
        with socket.create_connection(address(url)) as sock:
            sock.sendall(raw_chat(body[:10], length=len(body)))
            started = time.monotonic()
            assert closed_within(sock, 4)
            assert 0.8 < time.monotonic() - started < 3
        with socket.create_connection(address(url)) as sock:
            sock.sendall(raw_chat(b"", length=len(body)))
            for index in range(0, len(body), len(body) // 4 + 1):  # about 2 s in all
                time.sleep(0.5)
                sock.sendall(body[index : index + len(body) // 4 + 1])
            sock.settimeout(5)
            assert answer(sock)[0] == 200
    assert len(backend.forwarded) == 1


@pytest.mark.parametrize(
    "body_timeout", [2.0, 30.0], ids=["silence limit first", "deadline first (the default 30 s)"]
)
def test_bodies_trickled_to_hold_every_slot_are_cut_by_the_body_deadline(
    tmp_path: Path, cors: dict[str, Any], body_timeout: float
) -> None:
    """Four clients send a byte every 0.3 s: never silent, so only the whole-body deadline
    frees the four slots of ``--limit-concurrency 4`` (#33.3), however it compares with the
    silence limit."""
    app = gateway(
        tmp_path, limit_concurrency=4, body_timeout=body_timeout, body_deadline=3.0, **cors
    )
    stop = threading.Event()
    with serving(app, as_served=True) as url:
        tricklers = [socket.create_connection(address(url)) for _ in range(4)]

        def trickle() -> None:
            while not stop.is_set():
                for sock in tricklers:
                    with contextlib.suppress(OSError):
                        sock.sendall(b" ")
                time.sleep(0.3)

        for sock in tricklers:
            sock.sendall(raw_chat(b"", length=1000))
        started = time.monotonic()
        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            time.sleep(1.0)
            held = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=5)
            assert held.status_code == 503, held.text  # the four hold every slot for now
            assert httpx.get(f"{url}/health/live", timeout=5).status_code == 200
            for sock in tricklers:
                sock.settimeout(5)
                status, headers, body = answer(sock)
                assert status == 408 and headers["connection"] == "close"
                assert orjson.loads(body)["error"]["code"] == "request_timeout"
            assert 2.7 < time.monotonic() - started < 4.5  # the deadline, while still sending
            freed = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=5)
            assert freed.status_code == 200, freed.text
        finally:
            stop.set()
            thread.join()
            for sock in tricklers:
                sock.close()


def test_after_an_early_401_or_413_the_next_request_on_the_connection_is_answered(
    tmp_path: Path, cors: dict[str, Any]
) -> None:
    """The unread body of an early answer is dropped, never parsed as the next request; past
    1 MiB of it the answer says ``connection: close`` and the connection ends (#33.8)."""
    app = gateway(tmp_path, api_key=["sk-right"], max_body_bytes=64 * 1024, **cors)
    live = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"
    keyed = b"Authorization: Bearer sk-right\r\n"
    small = b'{"model": "base", "pad": "' + b"a" * 100_000 + b'"}'
    with serving(app, as_served=True) as url:
        for early, head_extra, body in [
            (401, b"", small),  # no key: refused before the body is read
            (413, keyed, small),  # over max_body_bytes, under the drain allowance
        ]:
            with socket.create_connection(address(url)) as sock:
                head = raw_chat(b"", length=len(body)).replace(
                    b"Host: localhost\r\n", b"Host: localhost\r\n" + head_extra
                )
                sock.sendall(head)
                sock.settimeout(5)
                status, _, _ = answer(sock)
                assert status == early
                sock.sendall(body + live)  # the body the client still sends, then a request
                assert answer(sock)[0] == 200  # in step: the body was dropped, not parsed
        with socket.create_connection(address(url)) as sock:
            sock.sendall(raw_chat(b"", length=4 * 1024 * 1024))  # 4 MiB declared, no key
            sock.settimeout(5)
            status, headers, _ = answer(sock)
            assert status == 401 and headers.get("connection") == "close"
            with contextlib.suppress(OSError):
                sock.sendall(b"x" * (2 * 1024 * 1024))
            assert closed_within(sock, 5)


# ----- a client that never reads ------------------------------------------------------------


class EndlessBackend(RecordingBackend):
    """Answers with a stream that never ends (64 KiB a piece, as fast as it is taken)."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces = 0
        self.stopped = threading.Event()

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            try:
                while True:
                    self.pieces += 1
                    yield b"x" * 65536
                    await asyncio.sleep(0)  # as a real source: it waits for its next piece
            finally:
                self.stopped.set()

        return StreamingResponse(pieces(), media_type="text/event-stream")


def test_a_stream_nobody_reads_is_closed_by_the_write_deadline_and_stops(
    tmp_path: Path, cors: dict[str, Any]
) -> None:
    backend = EndlessBackend()
    app = gateway(tmp_path, backend, write_timeout=1.0, **cors)
    with serving(app, as_served=True) as url, socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(address(url))
        sock.sendall(raw_chat(orjson.dumps({**CHAT, "stream": True})))
        started = time.monotonic()
        assert backend.stopped.wait(10), "the answer is still being made for nobody"
        assert time.monotonic() - started > 0.9  # the deadline, not an error
        assert closed_within(sock, 10)  # what was sent, then the close
        deadline = time.monotonic() + 3
        while app.state.gateway.metrics.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert app.state.gateway.metrics.in_flight == 0


# ----- header budgets -----------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_gigabyte_header_gets_a_431_and_costs_no_memory(tmp_path: Path) -> None:
    app = gateway(tmp_path)  # max_header_bytes: the default 64 KiB
    chunk = b"a" * (1 << 20)
    with serving(app, as_served=True) as url, socket.create_connection(address(url)) as sock:
        before = _rss_kib()
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        readable = select.poll()
        readable.register(sock, select.POLLIN)
        sent = 0
        for _ in range(1024):  # 1 GiB, in 1 MiB pieces, until the gateway answers or hangs up
            if readable.poll(0):
                break
            try:
                sock.sendall(chunk)
            except OSError:
                break
            sent += 1
        sock.settimeout(5)
        received = sock.recv(65536)
        grew = _rss_kib() - before
    assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    error = orjson.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "headers_too_large" and error["type"] == "invalid_request_error"
    assert sent < 64  # refused as the bytes came, not after a gigabyte
    assert grew < 8 * 1024, f"the gateway grew by {grew} KiB"


def test_past_max_headers_a_431_and_at_it_an_answer(tmp_path: Path, cors: dict[str, Any]) -> None:
    app = gateway(tmp_path, max_headers=20, **cors)

    def request(headers: int) -> bytes:  # Host is one of them
        extra = b"".join(b"X-H%d: v\r\n" % n for n in range(headers - 1))
        return b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n" + extra + b"\r\n"

    with serving(app, as_served=True) as url:
        with socket.create_connection(address(url)) as sock:
            sock.sendall(request(20))
            assert answer(sock)[0] == 200
        with socket.create_connection(address(url)) as sock:
            sock.sendall(request(21))
            status, headers, body = answer(sock)
            assert status == 431 and headers["connection"] == "close"
            assert orjson.loads(body)["error"]["code"] == "too_many_headers"
            assert closed_within(sock, 4)


def test_a_pipelined_request_gets_a_header_budget_of_its_own(tmp_path: Path) -> None:
    """A small request and a 127 KB header in one write: the second is a 431, not 200 on the
    first request's unused budget (#33.9)."""
    app = gateway(tmp_path)  # max_header_bytes: the default 64 KiB
    first = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"
    second = b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 127_000
    with serving(app, as_served=True) as url, socket.create_connection(address(url)) as sock:
        sock.sendall(first + second + b"\r\n\r\n")
        sock.settimeout(5)
        received = b""
        while chunk := sock.recv(65536):  # both answers, then the close
            received += chunk
    answers = received.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200", b"431"], received[:500]
    assert b"\r\nconnection: close\r\n" in answers[1].lower()
    assert orjson.loads(answers[1].partition(b"\r\n\r\n")[2])["error"]["code"] == (
        "headers_too_large"
    )


# ----- one address, many connections --------------------------------------------------------


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def test_connections_past_the_per_peer_cap_are_closed_at_once(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    app = gateway(tmp_path, max_connections_per_peer=3)
    with serving(app, as_served=True) as url:
        sockets += [socket.create_connection(address(url)) for _ in range(3)]
        extra = socket.create_connection(address(url))
        sockets.append(extra)
        assert closed_within(extra, 2)
        assert not closed_within(sockets[0], 0.3)  # the first three stay open
        sockets[0].close()
        deadline = time.monotonic() + 5
        while True:  # once the server has seen one close, a new connection is served
            try:
                status = httpx.get(f"{url}/health/live", timeout=2).status_code
            except httpx.TransportError:
                status = 0
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
