"""The gateway's own OpenTelemetry spans (``loragate.gateway.observe.spans``), sent over OTLP/HTTP to a
collector stand-in on a real socket, for real requests to ``gateway serve``'s hot path."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from loragate.gateway.app import create_app
from loragate.gateway.observe import spans
from loragate.gateway.observe.tracing import outgoing_trace_headers
from loragate.settings import Settings
from loragate.supervisor.command import EngineSpec, engine_argv
from tests.backend_double import ProxiedBackend, serving
from tests.unit.test_hot_routes import fake_engine
from tools.bench.fake_engine import FakeEngine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
DOCUMENTED = {
    "loragate.request",
    "loragate.admit",
    "loragate.check_request",
    "loragate.upstream",
    "loragate.relay",
}


@contextlib.contextmanager
def collector() -> Iterator[tuple[str, list[Any]]]:
    """An OTLP/HTTP collector stand-in: POST /v1/traces, protobuf; yields its URL and the
    spans it got so far."""
    received: list[Any] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        received.extend(scope_spans.spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()


class TraceRecordingBackend(ProxiedBackend):
    """The stand-in engine's backend, keeping the trace headers the engine would be sent."""

    sent: list[dict[str, str]]

    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(outgoing_trace_headers())
        return await super().forward(*args, **kwargs)


@pytest.fixture
def spans_off_after() -> Iterator[None]:
    yield
    spans.flush_spans()
    spans.enable_spans(Settings(otlp_traces_endpoint=None))


def _wait_for(received: list[Any], names: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans.flush_spans()
        by_name = {span.name: span for span in received}
        if names <= set(by_name):
            return by_name
        time.sleep(0.05)
    raise AssertionError(f"the collector got {sorted(s.name for s in received)}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_request_sends_the_documented_spans_under_the_clients_traceparent(
    tmp_path: Path, spans_off_after: None, stream: bool
) -> None:
    with (
        collector() as (endpoint, received),
        fake_engine(FakeEngine(api_key=None, models=["base"])) as engine,
    ):
        backend = TraceRecordingBackend(engine, ["base"])
        backend.sent = []
        settings = Settings(cache_dir=tmp_path, api_key=["k"], otlp_traces_endpoint=endpoint)
        with serving(create_app(settings, backend=backend), as_served=True) as url:
            response = httpx.post(
                url + "/v1/chat/completions",
                json={
                    "model": "base",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3,
                    "stream": stream,
                },
                headers={"Authorization": "Bearer k", "traceparent": TRACEPARENT},
                timeout=10,
            )
            assert response.status_code == 200
            by_name = _wait_for(received, DOCUMENTED)
    assert set(by_name) == DOCUMENTED  # no lease span: this backend leases no adapter
    root = by_name["loragate.request"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == CLIENT_SPAN
    for name in DOCUMENTED - {"loragate.request"}:
        assert by_name[name].trace_id.hex() == TRACE_ID
        assert by_name[name].parent_span_id == root.span_id, name
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["gen_ai.request.model"].string_value == "base"
    assert attributes["http.response.status_code"].int_value == 200
    upstream, relay = by_name["loragate.upstream"], by_name["loragate.relay"]
    assert upstream.end_time_unix_nano <= relay.start_time_unix_nano <= relay.end_time_unix_nano
    assert relay.end_time_unix_nano <= root.end_time_unix_nano
    # The engine is sent the gateway's upstream span as its parent: its spans join the trace.
    (sent,) = backend.sent
    assert sent["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id.hex()}-01"


def test_a_request_without_a_traceparent_starts_a_trace_of_its_own(
    tmp_path: Path, spans_off_after: None
) -> None:
    with (
        collector() as (endpoint, received),
        fake_engine(FakeEngine(api_key=None, models=["base"])) as engine,
    ):
        settings = Settings(cache_dir=tmp_path, api_key=["k"], otlp_traces_endpoint=endpoint)
        app = create_app(settings, backend=ProxiedBackend(engine, ["base"]))
        with serving(app, as_served=True) as url:
            response = httpx.post(
                url + "/v1/chat/completions",
                json={"model": "base", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": "Bearer k", "traceparent": "garbage"},
                timeout=10,
            )
            assert response.status_code == 200
            root = _wait_for(received, {"loragate.request"})["loragate.request"]
    assert root.parent_span_id == b"" and set(root.trace_id) != {0}


def test_without_an_endpoint_nothing_of_opentelemetry_is_imported(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from loragate.gateway.app import create_app\n"
        "from loragate.settings import Settings\n"
        f"create_app(Settings(cache_dir={str(tmp_path)!r}, upstream_url='http://127.0.0.1:9'))\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_endpoint_defaults_from_the_standard_otel_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert Settings().otlp_traces_endpoint == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/x")
    assert Settings().otlp_traces_endpoint == "http://traces:4318/x"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert Settings().otlp_traces_endpoint is None


def test_the_engine_gets_the_same_endpoint() -> None:
    spec = EngineSpec(
        model="m",
        served_name="m",
        socket_path=Path("/tmp/s"),
        api_key="k",
        max_loras=1,
        max_lora_rank=8,
        otlp_traces_endpoint="http://collector:4318/v1/traces",
    )
    argv = engine_argv(spec)
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces"
    theirs = replace(spec, extra_args=["--otlp_traces_endpoint=http://elsewhere:4317"])
    assert engine_argv(theirs).count("--otlp-traces-endpoint") == 0
