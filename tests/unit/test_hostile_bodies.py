"""Hostile request bodies (issue #33): wide, deep, or cut off midway, each answered as a bad
request is (an OpenAI-shaped 4xx, or a 499 for a client that left), fast, in bounded memory,
and without a traceback in the log.

Real sockets throughout: the gateway on ``gateway serve``'s own server in a thread of this
process, so its memory is this process's: the peak (``VmHWM``) is reset before each request
and read after it, and a second connection asks ``/health/live`` all along, to time how long
the event loop was held.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loragate.adapters.preset import Preset
from loragate.gateway.requests.body import brackets_of, containers, nesting
from tests.backend_double import (
    AdapterManagerDouble,
    ManagedBackendDouble,
    ProxiedBackend,
    app_with,
    serving,
    settings_for,
)
from tests.unit.test_hot_routes import fake_engine
from tools.bench.fake_engine import FakeEngine

MiB = 1 << 20
ADMIN_KEY = "the-admin"
TRACEBACK = "Traceback (most recent call last)"
JSON = {"Content-Type": "application/json"}


def peak_rss() -> int | None:
    """This process's peak resident memory since the last ``reset_peak_rss``, in bytes."""
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(found.group(1)) * 1024 if found else None


def rss() -> int:
    found = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found.group(1)) * 1024


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS (Linux 4.0+)
    except OSError:
        return False
    return True


class LivenessProbe:
    """Asks ``/health/live`` on its own keep-alive connection, back to back, and keeps the
    slowest answer: how long the gateway's event loop was held meanwhile."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.slowest = 0.0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.conn.request("GET", "/health/live")
            response = self.conn.getresponse()
            response.read()
            assert response.status == 200
            self.slowest = max(self.slowest, time.perf_counter() - started)
            self.answers += 1
            time.sleep(0.01)

    def __enter__(self) -> LivenessProbe:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.answers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.answers, "/health/live did not answer"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.conn.close()


@contextlib.contextmanager
def gateway(tmp_path: Path, **values: Any) -> Iterator[tuple[str, ManagedBackendDouble]]:
    """The gateway on its own server, in front of a backend that records what reaches it."""
    backend = ManagedBackendDouble()
    app = app_with(backend, settings_for(tmp_path, admin_key=ADMIN_KEY, **values))
    with serving(app, as_served=True) as url:
        yield url, backend


def post_measured(url: str, path: str, body: bytes) -> tuple[httpx.Response, float, float, int]:
    """``body`` posted to ``path``: the answer, its time, the slowest /health/live meanwhile,
    and how far the process's peak memory rose above what it held before."""
    with httpx.Client(base_url=url, timeout=60) as client, LivenessProbe(url) as probe:
        if not reset_peak_rss():
            pytest.skip("no /proc/self/clear_refs to reset the peak memory with")
        before = rss()
        started = time.perf_counter()
        answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
        took = time.perf_counter() - started
        peak = peak_rss()
    assert peak is not None
    return answer, took, probe.slowest, peak - before


# ----- width: bounded work, bounded memory (item 2) ------------------------------------------


def test_two_million_numbers_to_tokenize_hold_neither_memory_nor_the_loop(
    tmp_path: Path,
) -> None:
    # The body: 4 MB, two million numbers. A list of numbers is one array: taken, and
    # walked without a step (or a byte) per number; today +421-720 MiB and a 2.2 s stall.
    body = b'{"model": "base", "prompt": [' + b"1," * 1_999_999 + b"1]}"
    assert len(body) < 4 * MiB + 64
    with gateway(tmp_path) as (url, backend):
        answer, took, stall, grown = post_measured(url, "/tokenize", body)
        assert answer.status_code == 200, answer.text
        assert len(backend.forwarded[-1][1]["prompt"]) == 2_000_000
    print(f"tokenize 2e6 numbers: {took:.3f} s, /health/live {stall:.3f} s, +{grown / MiB:.0f} MiB")
    assert stall < 0.5
    assert took < 2.0
    # About 57 MiB measured: the 4 MB body a few times over (the client's sending, the
    # server's chunks and their join) and the 16 MB array are the floor.
    assert grown < 100 * MiB


def test_a_chat_of_a_million_text_parts_is_a_400_before_it_is_parsed(tmp_path: Path) -> None:
    # 27 MB, under the 32 MiB default body limit: a million objects would take ~300 MiB as
    # Python objects before anything looked at them (today +400 MB and a 3.2 s stall).
    parts = [{"type": "text", "text": "x"}] * 1_000_000
    body = orjson.dumps({"model": "base", "messages": [{"role": "user", "content": parts}]})
    with gateway(tmp_path) as (url, backend):
        answer, took, stall, grown = post_measured(url, "/v1/chat/completions", body)
        forwarded = len(backend.forwarded)
    print(f"chat 1e6 text parts: {took:.3f} s, /health/live {stall:.3f} s, +{grown / MiB:.0f} MiB")
    assert answer.status_code == 400, answer.text[:300]
    assert forwarded == 0
    error = answer.json()["error"]
    assert error["code"] == "body_too_wide"
    assert error["type"] == "invalid_request_error"
    assert "100000" in error["message"]
    assert stall < 0.5
    assert took < 3.0
    # About 90 MiB measured: the 27 MB body three times over (the client's sending, the
    # server's chunks and their join) and its brackets (~10 MB) read off it.
    assert grown < 150 * MiB


def test_braces_inside_strings_do_not_count_toward_the_budget(tmp_path: Path) -> None:
    # A long prompt of code: 300,000 braces and brackets, all inside one string.
    code = "function f(a) { return [a, {b: [1]}]; }\n" * 50_000
    body = orjson.dumps({"model": "base", "prompt": code, "tags": ['{"[' * 10] * 5000})
    with gateway(tmp_path) as (url, backend):
        answer = httpx.post(
            url + "/tokenize", content=body, headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 200, answer.text
    assert backend.forwarded[-1][1]["prompt"] == code


JSON_TEXT = st.text(alphabet='{}[]"\\/abu\n', max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(JSON_TEXT, inner, max_size=4),
    max_leaves=40,
)


@given(value=JSON_VALUES, limit=st.integers(0, 12), ascii_only=st.booleans())
def test_the_shape_read_on_the_bytes_is_the_parsed_body_s(
    value: Any, limit: int, ascii_only: bool
) -> None:
    # Braces, brackets, quotes and backslashes inside strings (keys too), escaped every way.
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    levels = [len(keys) + 1 for _, keys in containers(value)]
    depth = max(levels, default=0)
    brackets = brackets_of(raw, limit)
    if brackets is None:  # surely too wide
        assert len(levels) > limit
        return
    assert brackets.count(b"[") == len(levels)
    assert nesting(brackets, 1000) == depth
    assert nesting(brackets, limit) == min(depth, limit + 1)


def test_a_batch_of_real_size_is_still_taken(tmp_path: Path) -> None:
    # OpenAI's own embedding limits: 2,048 inputs; here each as 256 token ids.
    body = orjson.dumps({"model": "base", "input": [list(range(256))] * 2048})
    with gateway(tmp_path) as (url, backend):
        answer = httpx.post(
            url + "/v1/embeddings", content=body, headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 200, answer.text
    assert len(backend.forwarded[-1][1]["input"]) == 2048


# ----- a client that leaves mid-body (item 5) -------------------------------------------------

LEAVING = [
    ("POST", "/tokenize", "application/json"),
    ("POST", "/v1/chat/completions", "application/json"),
    ("POST", "/v1/audio/transcriptions", "multipart/form-data; boundary=xyz"),
    ("PUT", "/admin/adapters/gone", "application/json"),
]


@pytest.mark.parametrize("as_served", [True, False], ids=["gateway-serve", "uvicorn"])
@pytest.mark.parametrize(("method", "path", "content_type"), LEAVING)
def test_a_client_that_leaves_mid_body_is_a_499_without_a_traceback(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    as_served: bool,
    method: str,
    path: str,
    content_type: str,
) -> None:
    caplog.set_level(logging.INFO)
    backend = ManagedBackendDouble()
    settings = settings_for(tmp_path, admin_key=ADMIN_KEY, access_log=True)
    app = app_with(backend, settings)
    with serving(app, as_served=as_served) as url:
        host, port = url.removeprefix("http://").split(":")
        for _ in range(5):
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                head = (
                    f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {ADMIN_KEY}\r\n"
                    f"Content-Type: {content_type}\r\nContent-Length: 1000\r\n\r\n"
                )
                sock.sendall(head.encode() + b'{"model": "base", "inp')
                time.sleep(0.05)  # the gateway is reading the body when the client leaves
        metrics = app.state.gateway.metrics
        deadline = time.monotonic() + 5
        admin = path.startswith("/admin")  # not in the request metrics nor the access log
        while (
            metrics.in_flight or not (admin or metrics.requests)
        ) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
    counted = {status: n for (route, _, status), n in metrics.requests.items() if route == path}
    assert TRACEBACK not in caplog.text + capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert not backend.changed_anything()
    if admin:
        return
    assert counted == {499: 5}
    access = [r.getMessage() for r in caplog.records if r.name == "loragate.access"]
    assert len(access) == 5, access
    assert all(line.startswith(f"{method} {path} 499 ") for line in access), access


# ----- depth: one cap on every route, a 400 and no traceback (item 6) ----------------------------


def nested(depth: int, leaf: bytes = b'"x"') -> bytes:
    """JSON text ``depth`` objects deep (built as text: encoders stop short of such depths)."""
    return b'{"a": ' * depth + leaf + b"}" * depth


def deep_schema(depth: int) -> bytes:
    """A JSON Schema ``2 * depth`` levels deep: each object property an object again."""
    head = b'{"type": "object", "properties": {"a": '
    return head * depth + b'{"type": "string"}' + b"}}" * depth


CHAT = b'"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
DEEP_INFERENCE = [
    ("/v1/chat/completions", b"{" + CHAT + b', "extra": ' + nested(300) + b"}"),
    (
        "/v1/completions",
        b'{"model": "base", "prompt": "hi", "max_tokens": 2, "extra": ' + nested(300) + b"}",
    ),
    (
        "/v1/chat/completions",
        b"{" + CHAT + b', "response_format": {"type": "json_schema", "json_schema": '
        b'{"name": "deep", "schema": ' + deep_schema(100) + b"}}}",
    ),
    (
        "/v1/chat/completions",
        b"{"
        + CHAT
        + b', "structured_outputs": {"json": '
        + json.dumps(deep_schema(150).decode()).encode()
        + b"}}",
    ),
    ("/v1/embeddings", b'{"model": "base", "input": ' + nested(300) + b"}"),
]


@pytest.mark.parametrize("as_served", [True, False], ids=["hot-path", "asgi"])
@pytest.mark.parametrize(
    ("path", "body"),
    DEEP_INFERENCE,
    ids=["chat-extra", "completions-extra", "response-format", "schema-string", "embeddings"],
)
def test_a_deep_body_is_an_openai_400_on_every_route(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    as_served: bool,
    path: str,
    body: bytes,
) -> None:
    engine = FakeEngine(api_key=None, models=["base"])
    fine = {"model": "base", "prompt": "hi", "max_tokens": 2}
    with fake_engine(engine) as engine_url:
        backend = ProxiedBackend(engine_url, ["base"])
        app = app_with(backend, settings_for(tmp_path))  # type: ignore[arg-type]
        with serving(app, as_served=as_served) as url:
            answer = httpx.post(url + path, content=body, headers=JSON, timeout=30)
            assert httpx.post(url + "/v1/completions", json=fine).status_code == 200
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "body_too_deep"
    assert "64" in error["message"]
    assert engine.requests == 1  # the fine one: nothing of the deep body reached the engine
    assert TRACEBACK not in caplog.text + capfd.readouterr().err


class PresetCheckingAdapters(AdapterManagerDouble):
    """Checks a preset as the adapter manager does (``Preset.from_dict``) before recording."""

    async def put(self, name: str, source: str, *args: Any, preset: Any = None, **more: Any) -> Any:
        if preset is not None:
            Preset.from_dict(preset)
        return await super().put(name, source, *args, preset=preset, **more)


@pytest.mark.parametrize("depth", [100, 400])
def test_an_admin_put_with_a_deep_preset_is_a_400(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, depth: int
) -> None:
    backend = ManagedBackendDouble()
    backend.adapters = PresetCheckingAdapters()
    app = app_with(backend, settings_for(tmp_path, admin_key=ADMIN_KEY))
    body = (
        b'{"source": "hf://org/deep", "preset": {"response_format": '
        b'{"type": "json_schema", "json_schema": {"name": "deep", "schema": '
        + deep_schema(depth)
        + b"}}}}"
    )
    with serving(app, as_served=True) as url:
        answer = httpx.put(
            url + "/admin/adapters/deep",
            content=body,
            headers={**JSON, "Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "body_too_deep"
    assert backend.adapters.changes == []
    assert TRACEBACK not in caplog.text


class RecursingBackend(ManagedBackendDouble):
    """A backend that recurses without end on what it is sent (a custom one might)."""

    async def forward(self, *args: Any) -> Any:
        def down(level: int) -> int:
            return down(level + 1)

        return down(0)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/tokenize", {"model": "base", "prompt": "hi"}),  # the app's routes
        (
            "/v1/chat/completions",
            {"model": "base", "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
    ids=["asgi route", "hot route"],
)
def test_a_recursion_error_while_answering_is_a_400_without_a_traceback(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    route: str,
    body: dict[str, Any],
) -> None:
    app = app_with(RecursingBackend(), settings_for(tmp_path))
    with serving(app, as_served=True) as url:
        answer = httpx.post(url + route, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "body_too_deep"
    assert TRACEBACK not in caplog.text + capfd.readouterr().err
