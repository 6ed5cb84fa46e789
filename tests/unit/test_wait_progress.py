"""Progress of the long waits, in one record: a base model's download from a hub (bytes and
percent, in the record and in /health while it runs), the files a base-model snapshot skips
(``original/*``, ``*.pth``), a GGUF dequantization's tensors, and systemd's
``EXTEND_TIMEOUT_USEC`` while the start waits.

The hub is a stand-in on 127.0.0.1 that the real huggingface_hub talks to over HTTP (the
endpoint it read at import is pointed there for the test); it sends the weights slowly, so
that a test sees the download while it runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import json
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.base_model import gguf as gguf_model
from loragate.base_model.resolve import base_model_ignore_patterns, resolve_base_model
from loragate.fetching.progress import ProgressBoard, WaitProgress, current_progress
from loragate.gateway.app import create_app
from loragate.systemd import SystemdNotifier, extend_start_while
from tests.backend_double import serving, settings_for

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
REPO = "acme/llama-ish"
WEIGHTS = b"\x07" * (2 << 20)  # 2 MiB, sent in CHUNK pieces PAUSE apart
CHUNK = 64 << 10
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}',
    "model.safetensors": WEIGHTS,
    "original/consolidated.00.pth": b"\x01" * 4096,
    "original/params.json": b"{}",
}


class StandInHub(http.server.ThreadingHTTPServer):
    pause = 0.02  # between chunks of a file
    requests: list[str]


class _HubHandler(http.server.BaseHTTPRequestHandler):
    """The calls snapshot_download makes: the revision, the tree, then HEAD and GET each file."""

    server: StandInHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        self.server.requests.append(f"{self.command} {self.path}")
        path = self.path.split("?")[0]
        prefix = f"/api/models/{REPO}/"
        if path.startswith(prefix + "revision/"):
            siblings = [{"rfilename": name} for name in FILES]
            return self._json({"id": REPO, "sha": COMMIT, "siblings": siblings}, send_body)
        if path.startswith(prefix + "tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(body), "oid": _oid(body)}
                for name, body in FILES.items()
            ]
            return self._json(tree, send_body)
        resolve = f"/{REPO}/resolve/"
        if path.startswith(resolve):
            name = path[len(resolve) :].partition("/")[2]
            body = FILES.get(name)
            if body is not None:
                return self._file(body, send_body)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _json(self, value: object, send_body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def _file(self, body: bytes, send_body: bool) -> None:
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{_oid(body)}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not send_body:
            return
        try:
            for start in range(0, len(body), CHUNK):
                self.wfile.write(body[start : start + CHUNK])
                self.wfile.flush()
                time.sleep(self.server.pause)
        except OSError:
            pass  # the test is over


def _oid(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHub]:
    """The stand-in hub, with huggingface_hub pointed at it and its cache under tmp_path."""
    from huggingface_hub import constants

    server = StandInHub(("127.0.0.1", 0), _HubHandler)
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # It reports per chunk read, 10 MiB by default: the test's file is smaller.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _in_background(
    record: WaitProgress, cache_dir: Path
) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        current_progress.set(record)
        try:
            outcome["path"] = resolve_base_model(REPO, cache_dir)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_base_model_download_reports_bytes_and_percent_while_it_runs(
    hub: StandInHub, tmp_path: Path
) -> None:
    record = WaitProgress(name="base", source=REPO, stage="prepare")
    thread, outcome = _in_background(record, tmp_path / "cache")
    seen: list[tuple[int, int | None, float | None]] = []
    while thread.is_alive():
        if record.stage == "download" and record.bytes_done:
            seen.append((record.bytes_done, record.bytes_total, record.percent))
        time.sleep(0.02)
    assert "error" not in outcome, outcome
    partial = [s for s in seen if CHUNK <= s[0] < len(WEIGHTS)]
    assert partial, f"no progress seen while downloading: {seen[-3:]}"
    _done, total, percent = partial[len(partial) // 2]
    assert total is not None and total >= len(WEIGHTS)
    assert percent is not None and 0 < percent < 100
    assert record.bytes_done == record.bytes_total  # every byte counted once, none twice
    assert "download acme/llama-ish" in record.describe() and "MiB" in record.describe()


def test_a_base_model_snapshot_skips_the_original_checkpoint(
    hub: StandInHub, tmp_path: Path
) -> None:
    hub.pause = 0
    path = resolve_base_model(REPO, tmp_path / "cache")
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert not (path / "original").exists()
    fetched = [r for r in hub.requests if "/resolve/" in r]
    assert fetched and not any("original/" in r for r in fetched), fetched


def test_ignore_patterns_follow_vllms_choice_of_weights() -> None:
    hf_and_mistral = ["model-00001-of-00002.safetensors", "consolidated.safetensors"]
    assert "consolidated*" in base_model_ignore_patterns(hf_and_mistral)
    assert "consolidated*" not in base_model_ignore_patterns(["consolidated.safetensors"])
    with_bins = base_model_ignore_patterns(["model.safetensors", "pytorch_model.bin"])
    assert {"*.bin", "*.pth", "original/*"} <= set(with_bins)
    assert "*.bin" not in base_model_ignore_patterns(["pytorch_model.bin", "config.json"])


def test_health_shows_the_base_model_download_while_it_runs(
    hub: StandInHub, tmp_path: Path
) -> None:
    # 32 chunks: some 16 s, so a busy machine's slow start still sees the download midway;
    # the loop ends at the first progress it sees.
    hub.pause = 0.5
    settings = settings_for(tmp_path / "cache", model=REPO, engine_command=["false"])
    with serving(create_app(settings)) as url:
        deadline = time.monotonic() + 60
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            answer = httpx.get(f"{url}/health", timeout=5)
            body = answer.json()
            progress = body.get("progress") or {}
            if progress.get("stage") == "download" and progress.get("bytes_done"):
                break
            time.sleep(0.1)
        assert answer.status_code == 503
        progress = body["progress"]
        assert progress["source"] == REPO
        assert 0 < progress["bytes_done"] < progress["bytes_total"]
        assert 0 < progress["percent"] < 100
        assert progress["description"].startswith(f"download {REPO} ")


def test_gateway_pull_shows_the_download_percent_on_stderr(hub: StandInHub, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from loragate import cli

    hub.pause = 0.1  # some 3 s: several of the progress poll's turns
    result = CliRunner().invoke(cli.app, ["pull", REPO, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    partial = [line for line in lines if line.startswith("download ") and "100%" not in line]
    assert partial, lines
    assert "MiB of 2.0 MiB" in partial[-1]
    assert f"{REPO} is cached at" in result.stdout


def _stand_in_dequantizer(tmp_path: Path) -> str:
    """A python that, as ``-m loragate.base_model.dequantize SRC OUT``, reports three
    tensors as the real dequantizer does and writes nothing else."""
    script = tmp_path / "python"
    script.write_text(
        "#!/bin/sh\n"
        f"{sys.executable} -c '\n"
        "import sys, time\n"
        "for i in (1, 2, 3):\n"
        f'    print("{gguf_model.PROGRESS_PREFIX}%d/3" % i, flush=True); time.sleep(0.3)\n'
        'print("plain line", flush=True)\n'
        "'\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_dequantization_reports_tensors_done_of_total(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    record = WaitProgress(name="base", source="m.gguf", stage="dequantization")
    token = current_progress.set(record)
    seen: list[tuple[int, int | None]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append((record.steps_done, record.steps_total))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        gguf_model.run_dequantizer(
            tmp_path / "m.gguf", tmp_path / "out", python=_stand_in_dequantizer(tmp_path)
        )
    finally:
        stop.set()
        watcher.join()
        current_progress.reset(token)
    assert (1, 3) in seen and (2, 3) in seen
    assert record.percent == 100.0 and record.describe() == "dequantization m.gguf 100% (3 of 3)"
    out = capfd.readouterr().out
    assert "plain line" in out and gguf_model.PROGRESS_PREFIX not in out


def test_the_dequantizer_counts_each_tensor_it_dequantizes(
    capfd: pytest.CaptureFixture[str],
) -> None:
    gguf = pytest.importorskip("gguf")
    from loragate.base_model.dequantize import _count_tensors

    before = gguf.dequantize
    try:
        _count_tensors(2)
        data = __import__("numpy").zeros(4, dtype="float32")
        gguf.dequantize(data, gguf.GGMLQuantizationType.F32)
        gguf.dequantize(data, gguf.GGMLQuantizationType.F32)
    finally:
        gguf.dequantize = before
    lines = capfd.readouterr().out.splitlines()
    assert lines == [f"{gguf_model.PROGRESS_PREFIX}1/2", f"{gguf_model.PROGRESS_PREFIX}2/2"]


@pytest.fixture
def systemd(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    with tempfile.TemporaryDirectory(prefix="sd-", dir="/tmp") as short:
        path = os.path.join(short, "notify.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        server.bind(path)
        server.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        yield server
        server.close()


async def test_a_boot_extends_systemds_start_timeout_until_it_is_over(
    systemd: socket.socket,
) -> None:
    record = WaitProgress(name="base", source="acme/m", stage="boot")
    record.message = "12 s so far: loading weights"
    notes = asyncio.create_task(
        extend_start_while(
            SystemdNotifier(),
            lambda: None if record.finished else record.describe(),
            every=0.05,
            extend_by=30,
        )
    )
    first = (await asyncio.to_thread(systemd.recv, 4096)).decode()
    second = (await asyncio.to_thread(systemd.recv, 4096)).decode()
    record.enter("done")
    await asyncio.wait_for(notes, 5)
    assert first == second
    assert (
        first == "STATUS=boot acme/m (12 s so far: loading weights)\nEXTEND_TIMEOUT_USEC=30000000"
    )


def test_an_adds_record_keeps_its_stages_and_percent() -> None:
    board = ProgressBoard()
    with board.track("a", "hf://acme/a") as record:
        record.bytes_done, record.bytes_total = 50, 200
        assert record.as_dict()["percent"] == 25.0
        record.enter("conversion")
        assert record.as_dict()["percent"] == 100.0
    assert record.as_dict()["stages"] == ["download", "conversion", "validation", "store", "load"]
