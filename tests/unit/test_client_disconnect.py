"""Work nobody waits for: a client that hangs up stops its generation at the engine, and an
engine that stops answering is given up on.

Real sockets throughout: the stand-in engine (``tools.bench.fake_engine``, which like vLLM
aborts a generation whose connection closes, and records it) behind the real gateway under
uvicorn, both ways into the inference routes: the hot path (``gateway serve``'s protocol) and
plain ASGI (any other server, or CORS on).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from tests.backend_double import ProxiedBackend, serving
from tests.unit.test_hot_routes import (
    AUTH,
    chat,
    connection,
    fake_engine,
    gateway_app,
    raw_request,
)
from tools.bench.fake_engine import FakeEngine

WAYS_IN = pytest.mark.parametrize("as_served", [True, False], ids=["hot-path", "asgi"])


def wait_for(condition: Callable[[], object], seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


@WAYS_IN
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_hangs_up_midway_has_its_generation_aborted_at_the_engine(
    tmp_path: Path, as_served: bool, stream: bool
) -> None:
    # 100 tokens at 50 ms: the whole answer would take 5 s.
    engine = FakeEngine(api_key=None, models=["base"], token_interval=0.05)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        metrics = app.state.gateway.metrics
        with serving(app, as_served=as_served) as url:
            with connection(url) as (sock, shared):
                body = orjson.dumps(chat("base", max_tokens=100, stream=stream))
                headers = {"X-Request-ID": "left-early"}
                sock.sendall(raw_request("POST", "/v1/chat/completions", body, headers))
                if stream:
                    assert shared.file.readline().startswith(b"HTTP/1.1 200")
                    while b"data: " not in shared.file.readline():
                        pass
                else:
                    wait_for(lambda: engine.requests == 1)
                    assert engine.requests == 1
                    time.sleep(0.2)  # a few tokens in
            left = time.monotonic()
            wait_for(lambda: "left-early" in engine.aborted)
            assert time.monotonic() - left < 1.0, "the engine went on generating"
            assert engine.aborted["left-early"] < 100
            wait_for(lambda: metrics.in_flight == 0)
            assert metrics.in_flight == 0
            # The cut connection never went back to the pool: the next request answers whole.
            answer = httpx.post(
                url + "/v1/chat/completions", json=chat("base", max_tokens=2), headers=AUTH
            )
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["message"]["content"] == " x x"
            # The fake engine sees a plain answer's end one token interval after writing it:
            # the gateway's stop must not cut that connection first.
            time.sleep(3 * engine.token_interval)
    assert list(engine.aborted) == ["left-early"]


@WAYS_IN
def test_an_engine_that_never_answers_is_a_504_within_the_deadline(
    tmp_path: Path, as_served: bool
) -> None:
    """Through --upstream-url with --upstream-timeout 1: the engine takes the request and
    would answer in hours; the client gets a 504 after a second and the engine is cut off."""
    engine = FakeEngine(api_key=None, models=["base"], token_interval=1000.0)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, None, upstream_url=engine_url + "/v1", upstream_timeout=1)
        with serving(app, as_served=as_served) as url:
            started = time.monotonic()
            answer = httpx.post(
                url + "/v1/chat/completions",
                json=chat("base", max_tokens=2),
                headers={**AUTH, "X-Request-ID": "never"},
                timeout=10,
            )
            took = time.monotonic() - started
            wait_for(lambda: "never" in engine.aborted)
            assert app.state.gateway.metrics.in_flight == 0
    assert answer.status_code == 504, answer.text
    error = answer.json()["error"]
    assert error["code"] == "engine_timeout" and "1 s" in error["message"]
    assert error["message"].startswith("the upstream server ")
    assert 0.9 < took < 3.0
    assert engine.aborted == {"never": 0}


def test_a_stream_the_engine_stops_feeding_ends_with_a_timeout_event(tmp_path: Path) -> None:
    engine = FakeEngine(api_key=None, models=["base"], token_interval=1000.0)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, None, upstream_url=engine_url + "/v1", upstream_timeout=1)
        with serving(app, as_served=True) as url:
            answer = httpx.post(
                url + "/v1/chat/completions",
                json=chat("base", max_tokens=2, stream=True),
                headers={**AUTH, "X-Request-ID": "stalled"},
                timeout=10,
            )
            wait_for(lambda: "stalled" in engine.aborted)
    assert answer.status_code == 200
    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert orjson.loads(events[0])["error"]["code"] == "engine_timeout"
    assert events[-1] == "[DONE]"
    assert "stalled" in engine.aborted


def test_a_client_that_hangs_up_on_a_passthrough_generation_has_it_aborted(
    tmp_path: Path,
) -> None:
    # /v1/responses is one of the engine routes passed through (routes/passthrough.py), and a
    # plain Responses request generates its whole answer before anything is sent back.
    engine = FakeEngine(api_key=None, models=["base"], token_interval=0.05)
    with fake_engine(engine) as engine_url:
        app = gateway_app(tmp_path, ProxiedBackend(engine_url, ["base"]))
        with serving(app, as_served=True) as url:
            with connection(url) as (sock, _):
                body = orjson.dumps({"model": "base", "input": "hi", "max_tokens": 100})
                headers = {"X-Request-ID": "left-responses"}
                sock.sendall(raw_request("POST", "/v1/responses", body, headers))
                wait_for(lambda: engine.requests == 1)
                assert engine.requests == 1
                time.sleep(0.2)
            left = time.monotonic()
            wait_for(lambda: "left-responses" in engine.aborted)
            assert time.monotonic() - left < 1.0, "the engine went on generating"
            assert engine.aborted["left-responses"] < 100
