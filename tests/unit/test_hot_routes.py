"""The hot routes: inference POSTs answered on the gateway server's connections without ASGI.

Everything here runs over real sockets against ``gateway serve``'s own server in a thread
(``serving(app, as_served=True)``), and where it matters side by side with the same app on
plain uvicorn (the ASGI path, as an embedding user runs ``create_server()``), which must
answer the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response, StreamingResponse

from loragate.gateway.app import create_app
from loragate.gateway.server import hot_routes
from loragate.http.connection import UpstreamConnection
from loragate.settings import Settings
from tests.backend_double import ProxiedBackend, RecordingBackend, serving
from tools.bench.fake_engine import FakeEngine, start_server

KEY = "inference-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def chat(model: str = "pong", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture
def hot_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the hot routes answered (so a test knows the hot path, not ASGI, ran)."""
    calls: list[str] = []
    answer = hot_routes.answer

    async def counted(gateway: Any, exchange: Any, endpoint: Any) -> None:
        calls.append(exchange.scope["path"])
        await answer(gateway, exchange, endpoint)

    monkeypatch.setattr(hot_routes, "answer", counted)
    return calls


def gateway_app(tmp_path: Path, backend: Any, **values: Any) -> Any:
    settings = Settings(cache_dir=tmp_path, api_key=[KEY], **values)
    return create_app(settings, backend=backend)


# ----- raw HTTP/1.1 over one socket ---------------------------------------------------------


class _Unclosable:
    def __init__(self, file: io.BufferedReader) -> None:
        self._file = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def close(self) -> None:  # http.client closes its file after each response
        pass


class _SharedFile:
    """Lets several http.client responses read one buffered socket in turn (pipelining)."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def makefile(self, *args: Any, **kwargs: Any) -> _Unclosable:
        return _Unclosable(self.file)


def raw_request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway", f"Content-Length: {len(body)}"]
    if body:
        lines.append("Content-Type: application/json")
    lines += [f"{name}: {value}" for name, value in {**AUTH, **(headers or {})}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(shared: _SharedFile) -> tuple[int, dict[str, str], bytes]:
    response = http.client.HTTPResponse(shared, method="POST")  # type: ignore[arg-type]
    response.begin()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


@contextlib.contextmanager
def connection(
    url: str, receive_buffer: int | None = None
) -> Iterator[tuple[socket.socket, _SharedFile]]:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(10)
        if receive_buffer is not None:  # before connecting, so the window stays small
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.connect((host, int(port)))
        shared = _SharedFile(sock)
        try:
            yield sock, shared
        finally:
            shared.file.close()  # else the socket stays open behind its file


# ----- the same answers as the ASGI path ----------------------------------------------------

CASES: list[tuple[str, dict[str, str], bytes]] = [
    ("/v1/chat/completions", {}, orjson.dumps(chat())),
    ("/v1/chat/completions", {}, orjson.dumps(chat("base", max_tokens=3, stream=False))),
    ("/v1/completions", {}, orjson.dumps({"model": "pong", "prompt": "hi", "max_tokens": 2})),
    ("/v1/chat/completions", {}, b"{not json"),
    ("/v1/chat/completions", {}, b""),
    ("/v1/chat/completions", {}, b"[1, 2]"),
    ("/v1/chat/completions", {}, orjson.dumps(chat("nope"))),
    ("/v1/chat/completions", {}, orjson.dumps(chat(max_tokens=10_000))),
    ("/v1/chat/completions", {}, orjson.dumps(chat(temperature="hot"))),
    ("/v1/chat/completions", {}, orjson.dumps({"model": "pong", "source": "x"})),
    ("/v1/chat/completions", {}, orjson.dumps(chat(padding="x" * 5000))),  # past max body
    ("/v1/chat/completions", {"Authorization": "Bearer wrong"}, orjson.dumps(chat())),
    ("/v1/chat/completions", {"Authorization": ""}, orjson.dumps(chat())),
]


def _answer(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[Any, ...]:
    with connection(url) as (sock, shared):
        request_headers = {"Content-Type": "application/json", "X-Request-ID": "fixed-id"}
        sock.sendall(raw_request("POST", path, body, {**request_headers, **headers}))
        status, response_headers, content = read_response(shared)
    response_headers.pop("date", None)
    response_headers.pop("server", None)  # uvicorn names itself; the gateway server does not
    return status, response_headers, orjson.loads(content)


def test_the_hot_path_answers_as_the_asgi_path_does(tmp_path: Path, hot_calls: list[str]) -> None:
    values = {"max_body_bytes": 4096, "max_tokens_cap": 512}
    hot_app = gateway_app(tmp_path / "hot", RecordingBackend(), **values)
    asgi_app = gateway_app(tmp_path / "asgi", RecordingBackend(), **values)
    with serving(hot_app, as_served=True) as hot, serving(asgi_app) as asgi:
        for path, headers, body in CASES:
            assert _answer(hot, path, headers, body) == _answer(asgi, path, headers, body), (
                path,
                body[:60],
            )
    assert len(hot_calls) == len(CASES)


def test_answers_carry_the_request_id_and_security_headers(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    with fake_engine(FakeEngine(api_key=None, models=["base"])) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        with serving(app, as_served=True) as url:
            status, headers, body = _answer(
                url, "/v1/chat/completions", {}, orjson.dumps(chat("base", max_tokens=2))
            )
    assert status == 200 and body["choices"][0]["message"]["content"] == " x x"
    assert headers["x-request-id"] == "fixed-id"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["x-frame-options"] == "DENY"
    assert headers["content-length"] == str(len(orjson.dumps(body)))
    assert hot_calls == ["/v1/chat/completions"]


def test_cors_keeps_every_route_on_the_asgi_path_behind_the_same_limits(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    app = gateway_app(tmp_path, RecordingBackend(), cors_origins=["https://x"], max_headers=12)
    with serving(app, as_served=True) as url:
        answer = httpx.post(
            url + "/v1/chat/completions",
            json=chat(),
            headers={**AUTH, "Origin": "https://x"},
            timeout=10,
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://x"  # via the app
        crowded = {f"x-h{i}": "1" for i in range(14)}
        assert httpx.get(url + "/health", headers=crowded, timeout=10).status_code == 431
    assert hot_calls == []


# ----- HTTP/1.1 on one connection -----------------------------------------------------------


def test_one_connection_carries_hot_and_other_routes_in_turn(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    backend = RecordingBackend()
    with (
        serving(gateway_app(tmp_path, backend), as_served=True) as url,
        connection(url) as (sock, shared),
    ):
        for _ in range(5):
            sock.sendall(raw_request("POST", "/v1/chat/completions", orjson.dumps(chat())))
            assert read_response(shared)[0] == 200
            sock.sendall(raw_request("GET", "/v1/models"))
            status, _, body = read_response(shared)
            assert status == 200 and [m["id"] for m in orjson.loads(body)["data"]] == [
                "base",
                "pong",
            ]
            sock.sendall(raw_request("GET", "/health"))
            assert read_response(shared)[0] == 200
    assert len(backend.forwarded) == 5 and len(hot_calls) == 5


def test_pipelined_requests_are_answered_in_order(tmp_path: Path, hot_calls: list[str]) -> None:
    with (
        serving(gateway_app(tmp_path, RecordingBackend()), as_served=True) as url,
        connection(url) as (sock, shared),
    ):
        sock.sendall(
            raw_request("POST", "/v1/chat/completions", orjson.dumps(chat()),
                        {"X-Request-ID": "first"})
            + raw_request("GET", "/health")
            + raw_request("POST", "/v1/chat/completions", b"{bad", {"X-Request-ID": "third"})
            + raw_request("POST", "/v1/chat/completions", orjson.dumps(chat("base")),
                          {"X-Request-ID": "fourth"})
        )  # fmt: skip
        answers = [read_response(shared) for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 200, 400, 200]
    assert orjson.loads(answers[0][2])["id"] == "first"
    assert orjson.loads(answers[3][2])["id"] == "fourth"
    assert orjson.loads(answers[3][2])["model"] == "base"
    assert len(hot_calls) == 3


def test_connection_close_is_honoured(tmp_path: Path) -> None:
    with (
        serving(gateway_app(tmp_path, RecordingBackend()), as_served=True) as url,
        connection(url) as (sock, shared),
    ):
        sock.sendall(
            raw_request("POST", "/v1/chat/completions", orjson.dumps(chat()),
                        {"Connection": "close"})
        )  # fmt: skip
        status, headers, _ = read_response(shared)
        assert status == 200 and headers["connection"] == "close"
        assert shared.file.read() == b""  # the server closed its end


def test_a_body_sent_in_pieces_and_after_100_continue_is_read_whole(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    backend = RecordingBackend()
    body = orjson.dumps(chat(max_tokens=7))
    with (
        serving(gateway_app(tmp_path, backend), as_served=True) as url,
        connection(url) as (sock, shared),
    ):
        request = raw_request("POST", "/v1/chat/completions", body)
        head, _, _ = request.partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        for start in range(0, len(body), 10):
            time.sleep(0.01)
            sock.sendall(body[start : start + 10])
        assert read_response(shared)[0] == 200

        sock.sendall(head + b"\r\nExpect: 100-continue\r\n\r\n")
        assert shared.file.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert shared.file.readline() == b"\r\n"
        sock.sendall(body)
        assert read_response(shared)[0] == 200
    assert [payload["max_tokens"] for _, payload in backend.forwarded] == [7, 7]
    assert len(hot_calls) == 2


def test_a_chunked_body_past_the_limit_is_refused(tmp_path: Path) -> None:
    backend = RecordingBackend()
    app = gateway_app(tmp_path, backend, max_body_bytes=1000)
    with serving(app, as_served=True) as url, connection(url) as (sock, shared):
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {KEY}"
            "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        sock.sendall(head + b"%x\r\n%s\r\n" % (600, b"x" * 600))
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (600, b"y" * 600))
        status, _, body = read_response(shared)
        assert status == 413 and orjson.loads(body)["error"]["code"] == "request_too_large"
        # The connection is still in step: the next request is answered.
        sock.sendall(raw_request("POST", "/v1/chat/completions", orjson.dumps(chat())))
        assert read_response(shared)[0] == 200
    assert len(backend.forwarded) == 1


# ----- failures and other response types -----------------------------------------------------


class FailingBackend(RecordingBackend):
    async def forward(self, *args: Any) -> Response:
        raise RuntimeError("backend bug")


class StreamingBackend(RecordingBackend):
    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        async def events() -> AsyncIterator[bytes]:
            for word in ("one", "two"):
                yield b"data: " + orjson.dumps({"model": public_model, "word": word}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def test_a_backend_failure_is_an_openai_500_and_the_connection_lives_on(tmp_path: Path) -> None:
    with (
        serving(gateway_app(tmp_path, FailingBackend()), as_served=True) as url,
        connection(url) as (sock, shared),
    ):
        sock.sendall(raw_request("POST", "/v1/chat/completions", orjson.dumps(chat())))
        status, headers, body = read_response(shared)
        assert status == 500 and headers["content-type"] == "application/json"
        assert orjson.loads(body)["error"]["type"] == "api_error"
        sock.sendall(raw_request("GET", "/health"))
        assert read_response(shared)[0] == 200


def test_a_custom_backend_stream_goes_out_with_the_usual_headers(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    with serving(gateway_app(tmp_path, StreamingBackend()), as_served=True) as url:
        response = httpx.post(
            url + "/v1/chat/completions", json=chat(stream=True), headers=AUTH, timeout=10
        )
    assert response.status_code == 200
    assert response.headers["x-content-type-options"] == "nosniff"
    words = [
        orjson.loads(line[6:])["word"]
        for line in response.text.split("\n\n")
        if line.startswith("data: {")
    ]
    assert words == ["one", "two"] and hot_calls == ["/v1/chat/completions"]


# ----- streams relayed from an engine ---------------------------------------------------------


@contextlib.contextmanager
def fake_engine(state: FakeEngine) -> Iterator[str]:
    """The fake engine on its own event loop in a thread; yields its URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def run() -> None:
        server = await start_server(state)
        holder["port"] = server.sockets[0].getsockname()[1]
        holder["stop"] = asyncio.Event()
        ready.set()
        async with server:
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(10)


def test_a_relayed_stream_arrives_whole_and_is_counted(
    tmp_path: Path, hot_calls: list[str]
) -> None:
    engine = FakeEngine(api_key=None, models=["base"], token_interval=0.005)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        with serving(app, as_served=True) as url:
            with httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                json=chat("base", stream=True, max_tokens=5),
                headers={**AUTH, "X-Request-ID": "streamed"},
                timeout=10,
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                assert response.headers["x-request-id"] == "streamed"
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            scrape = httpx.get(url + "/metrics", timeout=10).text
    assert events[-1] == "data: [DONE]" and len(events) == 6
    assert "".join(orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]) == (
        " x" * 5
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
    }
    labels = (("model_name", "base"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert samples[("loragate_requests_total", labels)] == 1
    assert samples[("loragate_time_to_first_token_seconds_count", (("model_name", "base"),))] == 1
    assert samples[("loragate_requests_in_flight", ())] == 0
    assert hot_calls == ["/v1/chat/completions"]


def test_a_client_leaving_midstream_stops_the_generation(tmp_path: Path) -> None:
    engine = FakeEngine(api_key=None, models=["base"], token_interval=0.05)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        with serving(app, as_served=True) as url:
            with connection(url) as (sock, shared):
                body = orjson.dumps(chat("base", stream=True, max_tokens=100))
                sock.sendall(raw_request("POST", "/v1/chat/completions", body))
                assert shared.file.readline().startswith(b"HTTP/1.1 200")
                while b"data: " not in shared.file.readline():
                    pass
            # 100 tokens at 50 ms would take 5 s; the engine sees the hang-up within a token.
            deadline = time.monotonic() + 3
            while engine.streams_cut == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.streams_cut == 1
            deadline = time.monotonic() + 3
            while app.state.gateway.metrics.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
            assert app.state.gateway.metrics.in_flight == 0


def test_hot_requests_are_counted_by_model_and_status(tmp_path: Path, hot_calls: list[str]) -> None:
    app = gateway_app(tmp_path, RecordingBackend())
    with serving(app, as_served=True) as url, httpx.Client(base_url=url, timeout=10) as client:
        for model in ("pong", "pong", "base"):
            assert client.post("/v1/chat/completions", json=chat(model), headers=AUTH).is_success
        assert (
            client.post("/v1/chat/completions", json=chat("nope"), headers=AUTH).status_code == 404
        )
        assert client.post("/v1/chat/completions", json=chat("pong")).status_code == 401
        scrape = client.get("/metrics").text
    counts = {
        (s.labels["model_name"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == "loragate_requests_total"
    }
    assert counts == {
        ("pong", "200"): 2,
        ("base", "200"): 1,
        ("unknown", "404"): 1,
        ("unknown", "401"): 1,
    }
    assert len(hot_calls) == 5


def test_access_log_lines_name_each_hot_request(
    tmp_path: Path, hot_calls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loragate.access")
    app = gateway_app(tmp_path, RecordingBackend(), access_log=True)
    with serving(app, as_served=True) as url, httpx.Client(base_url=url, timeout=10) as client:
        headers = {**AUTH, "X-Request-ID": "logged-1"}
        assert client.post("/v1/chat/completions", json=chat(), headers=headers).is_success
        assert (
            client.post("/v1/chat/completions", json=chat("nope"), headers=AUTH).status_code == 404
        )
    records = [r for r in caplog.records if r.name == "loragate.access"]
    fields = [
        (r.__dict__["request_id"], r.__dict__["model"], r.__dict__["status"]) for r in records
    ]
    assert fields[0] == ("logged-1", "pong", 200)
    assert fields[1][1:] == (None, 404)
    assert "POST /v1/chat/completions 200 model=pong request_id=logged-1" in records[0].getMessage()
    assert len(hot_calls) == 2


def test_a_slow_reader_gets_a_long_stream_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine writes 20,000 events (4 MB) at once; the client reads none for a while, then all.

    The relay stops reading the engine while the client's socket is full and goes on when it
    drains (back-pressure), and nothing is lost or reordered on the way.
    """
    holds: list[bool] = []
    hold = UpstreamConnection.hold

    def counted_hold(self: UpstreamConnection) -> None:
        holds.append(True)
        hold(self)

    monkeypatch.setattr(UpstreamConnection, "hold", counted_hold)
    engine = FakeEngine(api_key=None, models=["base"])
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        with serving(app, as_served=True) as url, connection(url, 4096) as (sock, shared):
            body = orjson.dumps(chat("base", stream=True, max_tokens=20_000))
            sock.sendall(raw_request("POST", "/v1/chat/completions", body))
            time.sleep(1.0)
            status, _, content = read_response(shared)
    events = [e for e in content.split(b"\n\n") if e.startswith(b"data: ")]
    assert status == 200 and len(events) == 20_001 and events[-1] == b"data: [DONE]"
    assert all(orjson.loads(e[6:])["model"] == "base" for e in events[:-1])
    assert holds  # the engine was paused at least once
