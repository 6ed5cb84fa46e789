"""`gateway adapters add` shows the gateway's progress record while the PUT runs: against a
stand-in gateway whose add goes through download (with bytes), conversion and loading."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from loragate import cli
from loragate.cli_progress import progress_line, run_showing_progress

MIB = 1 << 20
STEPS = [
    {"stage": "download", "bytes_done": 0, "bytes_total": None, "percent": None},
    {"stage": "download", "bytes_done": 5 * MIB, "bytes_total": 20 * MIB, "percent": 25.0},
    {"stage": "download", "bytes_done": 20 * MIB, "bytes_total": 20 * MIB, "percent": 100.0},
    {"stage": "convert", "bytes_done": 20 * MIB, "bytes_total": 20 * MIB, "percent": 100.0},
    {"stage": "load", "bytes_done": 20 * MIB, "bytes_total": 20 * MIB, "percent": 100.0},
]


class _Gateway(http.server.BaseHTTPRequestHandler):
    """PUT takes a while and moves the record a step each 0.6 s; GET serves the record."""

    record: dict[str, Any] | None = None
    stale: dict[str, Any] | None = None

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        record = type(self).record or type(self).stale
        self._send(200, {"name": "fox", "state": "adding", "progress": record})

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        started = time.time()
        for step in STEPS:
            type(self).record = {**step, "started_at": started, "finished": False}
            time.sleep(0.6)
        type(self).record = {**STEPS[-1], "stage": "ready", "started_at": started, "finished": True}
        self._send(200, {"name": "fox", "version": "ab" * 32, "state": "ready"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def gateway_url() -> Iterator[str]:
    _Gateway.record = None
    _Gateway.stale = {**STEPS[1], "started_at": time.time() - 3600, "finished": False}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_adapters_add_shows_each_stage_and_the_download_percent(gateway_url: str) -> None:
    result = CliRunner().invoke(
        cli.app, ["adapters", "add", "fox", "/srv/fox", "--url", gateway_url, "--admin-key", "k"]
    )
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    assert "download 25% (5.0 MiB of 20.0 MiB)" in lines
    assert "convert..." in lines and "load..." in lines
    assert lines.index("convert...") < lines.index("load...")
    assert len(lines) == len(set(lines))  # each change once
    assert "fox now serves version abababababab (ready)." in result.stdout


def test_a_failing_add_still_fails_with_its_reason() -> None:
    def call() -> None:
        raise cli.typer.Exit(2)

    with pytest.raises(cli.typer.Exit):
        run_showing_progress(call, lambda: None, time.time(), lambda line: None)


@pytest.mark.parametrize(
    ("record", "line"),
    [
        (None, None),
        ({"stage": "ready", "finished": True}, None),
        ({"stage": "download", "bytes_done": 0}, "  download..."),
        ({"stage": "download", "bytes_done": 3 * MIB}, "  download 3.0 MiB"),
        ({"stage": "validate"}, "  validate..."),
    ],
)
def test_progress_lines(record: dict[str, Any] | None, line: str | None) -> None:
    assert progress_line(record) == line
