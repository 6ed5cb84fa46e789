"""The engine's output where operators look: on the gateway's stderr (prefixed, escaped,
secrets hidden) as well as in CACHE_DIR/logs/engine.log, which rotates by size while the
engine runs; vLLM's per-request access lines off; ``--log-json`` lines keep the trace id.

The engine is the stand-in (``tools.bench.fake_engine``) run behind a few lines of Python
that print what a vLLM boot would.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import Response

from loragate.engine_states import EngineState
from loragate.gateway.app import create_app
from loragate.logs import JsonFormatter, configure_logging, echo_line
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.command import EngineSpec, engine_argv
from loragate.supervisor.engine import EngineSupervisor
from loragate.supervisor.failure import last_boot_lines
from loragate.supervisor.output import EngineLogFile, EngineOutput, tail_lines
from tests.backend_double import RecordingBackend, settings_for

SECRET = "hf_EchoSeCrEt0123456789"
# Prints a few lines as vLLM does (one with a terminal escape, one quoting its --hf-token),
# then runs the stand-in engine; with LORAGATE_BENCH_CHATTER=N it prints N more lines, a
# kibibyte each, while it serves.
TALKING_ENGINE = [
    sys.executable,
    "-c",
    "import os, sys, threading, runpy\n"
    "print('(APIServer pid=1) INFO vLLM API server version 0.32.0', flush=True)\n"
    "print('\\x1b[32mcoloured\\x1b[0m hf token', sys.argv[sys.argv.index('--hf-token') + 1],"
    " file=sys.stderr, flush=True)\n"
    "def chatter():\n"
    "    for n in range(int(os.environ.get('LORAGATE_BENCH_CHATTER', '0'))):\n"
    "        print(f'chatter {n:06d} ' + 'x' * 1000, flush=True)\n"
    "threading.Thread(target=chatter, daemon=True).start()\n"
    "sys.argv = ['fake_engine'] + sys.argv[1:]\n"
    "runpy.run_module('tools.bench.fake_engine', run_name='__main__')\n",
]
FAST = SupervisionFields(
    startup_timeout=30, probe_interval=0.2, probe_timeout=0.5, probe_failures=2,
    restart_backoff=0.05, restart_backoff_max=0.2, crash_loop_limit=3, crash_loop_window=60,
    stable_after=60, stop_timeout=5,
)  # fmt: skip


def talking_supervisor(tmp_path: Path, **spec_options: object) -> EngineSupervisor:
    def build(socket_path: Path, api_key: str) -> EngineSpec:
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=TALKING_ENGINE,
            extra_args=["--hf-token", SECRET], **spec_options,  # type: ignore[arg-type]
        )  # fmt: skip

    return EngineSupervisor(build, cache_dir=tmp_path, timings=FAST)


async def until(predicate, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_engine_lines_reach_the_gateways_stderr_prefixed_and_the_log_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    supervisor = talking_supervisor(tmp_path)
    written: list[str] = []  # ``readouterr`` empties the capture each time

    def printed(text: str) -> bool:
        written.append(capfd.readouterr().err)
        return text in "".join(written)

    await supervisor.start()
    try:
        await supervisor.wait_until_serving(30)
        await until(lambda: printed("coloured"))
    finally:
        await supervisor.stop()
    err = "".join(written)
    assert "engine | (APIServer pid=1) INFO vLLM API server version 0.32.0" in err
    # Escaped and with the secret hidden, as every log line the gateway writes.
    assert "engine | \\x1b[32mcoloured\\x1b[0m hf token ***" in err
    assert SECRET not in err and "\x1b" not in err
    # The file has the engine's own bytes, as before.
    text = supervisor.log_path.read_text()
    assert "vLLM API server version 0.32.0" in text and "\x1b[32mcoloured" in text


async def test_with_the_setting_off_engine_lines_go_to_the_file_only(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    supervisor = talking_supervisor(tmp_path, log_to_stderr=False)
    await supervisor.start()
    try:
        await supervisor.wait_until_serving(30)
        await until(lambda: "coloured" in supervisor.log_path.read_text())
    finally:
        await supervisor.stop()
    err = capfd.readouterr().err
    # (The gateway's own "spawning engine" line quotes the stand-in's source, which holds the
    # same words: only lines the engine printed carry the prefix.)
    assert not [line for line in err.splitlines() if line.startswith("engine | ")], err
    assert "vLLM API server version" in supervisor.log_path.read_text()


async def test_the_log_file_rotates_past_its_size_while_the_engine_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_BENCH_CHATTER", "600")  # 600 KiB of output
    limit = 100 * 1024
    supervisor = talking_supervisor(tmp_path, log_max_bytes=limit, log_to_stderr=False)
    log = supervisor.log_path
    await supervisor.start()
    try:
        await supervisor.wait_until_serving(30)
        # The last line may have gone to engine.log.1, when it filled that file.
        await until(lambda: "chatter 000599" in "".join(tail_lines(log, 5)))
        assert supervisor.state == EngineState.READY  # rotated under a running engine
        pid = supervisor.engine_pid
    finally:
        await supervisor.stop()
    files = [log, *(log.with_suffix(f".log.{n}") for n in (1, 2, 3))]
    assert all(path.exists() for path in files)
    assert not log.with_suffix(".log.4").exists()  # three rotated files kept, no more
    # Each file holds at most one read past the limit, and only whole lines.
    for path in files:
        assert path.stat().st_size <= limit + 64 * 1024
        lines = path.read_text().splitlines()
        assert all(line.startswith("chatter ") for line in lines if "chatter" in line)
        assert all(
            len(line) == len("chatter 000000 ") + 1000 for line in lines if "chatter" in line
        )
    assert pid is not None


def test_the_boot_failure_reader_finds_the_boot_whose_banner_was_rotated(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log_file = EngineLogFile(log, max_bytes=4096)
    log_file.start_boot()
    log_file.write(b"an earlier boot's line\n")
    log_file.start_boot()  # the boot that fails
    log_file.write(b"(APIServer pid=7) INFO starting\n")
    for n in range(60):
        log_file.write(f"(EngineCore pid=8) INFO line {n:03d} {'y' * 80}\n".encode())
    log_file.write(b"(EngineCore pid=8) ValueError: no such model\n")
    log_file.close()
    assert log.with_suffix(".log.1").exists()
    assert "engine boot at" not in log.read_text()  # the banner is in engine.log.1
    lines = last_boot_lines(log)
    assert lines[0] == "(APIServer pid=7) INFO starting"
    assert lines[-1] == "(EngineCore pid=8) ValueError: no such model"
    assert not any("earlier boot" in line for line in lines)
    assert tail_lines(log, 3)[-1].endswith("no such model")


def test_a_slow_stderr_never_holds_the_engine_back_and_says_what_it_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stderr is a real pipe nobody reads until later: it fills after 64 KiB.
    read_end, write_end = os.pipe()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(os.fdopen(write_end, "wb")))
    engine_end, gateway_end = os.pipe()
    log_file = EngineLogFile(tmp_path / "engine.log", max_bytes=1 << 30)
    log_file.start_boot()
    output = EngineOutput(os.fdopen(engine_end, "rb"), log_file, to_stderr=True)
    output.start()
    lines = 20_000
    with os.fdopen(gateway_end, "wb") as engine:
        for n in range(lines):
            engine.write(f"line {n:05d} {'z' * 100}\n".encode())
    output.join(20)  # every line reached the file although stderr took none
    text = (tmp_path / "engine.log").read_text()
    assert text.count("\nline ") == lines
    drained = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 1 << 16):
            drained.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + 20
    while b"stderr was slow" not in drained or not drained.endswith(b")\n"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shown = drained.decode()
    assert "lines not shown here, stderr was slow: see" in shown
    assert shown.count("engine | line ") < lines
    sys.stderr.close()
    os.close(read_end)


def test_lines_on_stderr_follow_the_gateways_log_format() -> None:
    try:
        configure_logging("info", as_json=True)
        entry = json.loads(echo_line("engine", "INFO ready\x1b[0m"))
        assert entry["logger"] == "engine" and entry["message"] == "INFO ready\\x1b[0m"
        configure_logging("info", as_json=False)
        assert echo_line("engine", "INFO ready") == "engine | INFO ready"
    finally:
        logging.getLogger().handlers[:] = []


def test_the_engine_logs_no_line_per_request_unless_its_own_arguments_say() -> None:
    def argv(*extra: str) -> list[str]:
        return engine_argv(
            EngineSpec(
                model="m",
                served_name="m",
                socket_path=Path("/s"),
                api_key="k",
                max_loras=1,
                max_lora_rank=8,
                extra_args=list(extra),
            )
        )

    assert argv().count("--disable-uvicorn-access-log") == 1
    assert "--disable-uvicorn-access-log" not in argv("--no-disable-uvicorn-access-log")
    assert "--disable-uvicorn-access-log" not in argv("--disable_access_log_for_endpoints=/x")
    assert argv("--disable-uvicorn-access-log").count("--disable-uvicorn-access-log") == 1


class _TalkativeBackend(RecordingBackend):
    """Logs a line of its own while it answers, as the adapter manager or the proxy do."""

    async def forward(self, *args: Any, **kwargs: Any) -> Response:
        logging.getLogger("loragate.gateway").warning("answering from the backend")
        return await super().forward(*args, **kwargs)


async def test_json_log_lines_of_a_request_carry_its_trace_and_request_ids(tmp_path: Path) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    loggers = [logging.getLogger(name) for name in ("loragate.access", "loragate.gateway")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    app = create_app(settings_for(tmp_path, access_log=True), backend=_TalkativeBackend())
    try:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
            ) as client,
        ):
            stream.truncate(0)
            stream.seek(0)
            await client.post(
                "/v1/chat/completions",
                json={"model": "base", "messages": [{"role": "user", "content": "hi"}]},
                headers={"traceparent": f"00-{trace}-00f067aa0ba902b7-01", "x-request-id": "r1"},
            )
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    entries = {entry["logger"]: entry for entry in map(json.loads, stream.getvalue().splitlines())}
    for name in ("loragate.access", "loragate.gateway"):
        assert entries[name]["trace_id"] == trace and entries[name]["request_id"] == "r1", entries
    assert entries["loragate.gateway"]["message"] == "answering from the backend"
