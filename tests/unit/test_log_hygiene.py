"""What reaches a log line, the ``/admin/logs`` tail, ``/health`` and the status page.

A client's path, model or request id holding a line feed or an ANSI escape must not forge a
log line or drive the reader's terminal; the secrets given to the engine after ``--``
(``--hf-token``) must not be shown, whether loragate prints its command or the engine does.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from loragate.engine_states import EngineState
from loragate.gateway.app import create_app
from loragate.gateway.observe.log_tail import engine_lines
from loragate.logs import FORMAT, JsonFormatter, SafeFormatter, loggable, printable
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.command import EngineSpec, redacted, secret_values
from loragate.supervisor.engine import EngineSupervisor
from tests.backend_double import ManagedBackendDouble, RecordingBackend, serving, settings_for

FORGED_PATH = "/v1/responses/x%0aFORGED%1b[31m"


class _Written:
    """A handler on a logger that writes what a formatter makes of each record, as the
    gateway's stderr (or its JSON log) would hold it."""

    def __init__(self, logger: logging.Logger, formatter: logging.Formatter) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(formatter)
        self.logger, self.level = logger, logger.level

    def __enter__(self) -> _Written:
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)

    def lines(self) -> list[str]:
        return self.stream.getvalue().splitlines()


@pytest.fixture
def access_log() -> Iterator[_Written]:
    # A plain formatter: the line must be safe whatever formatter an embedding app set up.
    with _Written(logging.getLogger("loragate.access"), logging.Formatter(FORMAT)) as written:
        yield written


def test_a_forged_path_leaves_one_access_log_line_with_its_escapes_shown(
    tmp_path: Path, access_log: _Written
) -> None:
    app = create_app(settings_for(tmp_path, access_log=True), backend=RecordingBackend())
    with serving(app, as_served=True) as url:
        connection = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
        connection.request("GET", FORGED_PATH)
        connection.getresponse().read()
        connection.close()
        deadline = time.monotonic() + 5  # written just after the answer is sent
        while not access_log.lines():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    [line] = access_log.lines()
    assert "GET /v1/responses/x\\nFORGED\\x1b[31m " in line
    assert "\x1b" not in line and "FORGED" not in line.split("\\n", 1)[0]


async def test_the_gateway_log_tail_keeps_a_forged_message_on_one_line(tmp_path: Path) -> None:
    app = create_app(settings_for(tmp_path, host="127.0.0.1"), backend=ManagedBackendDouble())
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
        ) as client,
    ):
        key = (tmp_path / "admin-token").read_text().strip()
        logging.getLogger("loragate.gateway").warning(
            "no such model %s", "m\nFORGED-TAIL ERROR\x1b[2J\u2028X"
        )
        answer = await client.get(
            "/admin/logs", params={"source": "gateway"}, headers={"Authorization": f"Bearer {key}"}
        )
    lines = [orjson.loads(row)["line"] for row in answer.text.splitlines()]
    forged = [line for line in lines if "FORGED-TAIL" in line]  # the ring is the process's
    assert len(forged) == 1, lines
    assert forged[0].endswith("no such model m\\nFORGED-TAIL ERROR\\x1b[2J\\u2028X")


async def test_the_engine_log_tail_escapes_what_the_engine_printed(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes("\x1b[32mINFO\x1b[0m prompt: a\u2028FORGED\x0cB\r\nnext\n".encode())
    lines = [line async for line in engine_lines(log, 10, follow=False)]
    assert lines == ["\\x1b[32mINFO\\x1b[0m prompt: a\\u2028FORGED\\x0cB", "next"]


def test_json_logs_and_tracebacks_are_escaped_too() -> None:
    record = logging.LogRecord(
        "loragate.gateway", logging.ERROR, __file__, 1, "bad %s", ("a\nb",), None
    )
    record.model = "m\x1b[31m"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "bad a\\nb" and entry["model"] == "m\\x1b[31m"
    try:
        raise ValueError("x\x1b[31my")
    except ValueError:
        record.exc_info = sys.exc_info()
    text = SafeFormatter(FORMAT).format(record)
    assert "\x1b" not in text and "ValueError: x\\x1b[31my" in text
    assert text.count("\n") >= 2  # the traceback keeps its lines
    assert printable(printable("a\nb\\n")) == "a\\nb\\n"  # escaping twice changes nothing


# ----- secrets on the engine's command line ------------------------------------------------------


def test_secret_flags_are_redacted_in_either_form_and_others_are_not() -> None:
    argv = [
        "vllm", "--hf-token", "hf_x1", "--api-key=k2", "--db_password", "p3",
        "--tokenizer", "org/tok", "--max-num-batched-tokens", "2048",
        "--return-tokens-as-token-ids", "--model", "m",
    ]  # fmt: skip
    assert redacted(argv) == [
        "vllm", "--hf-token", "***", "--api-key=***", "--db_password", "***",
        "--tokenizer", "org/tok", "--max-num-batched-tokens", "2048",
        "--return-tokens-as-token-ids", "--model", "m",
    ]  # fmt: skip
    assert secret_values(argv) == ["hf_x1", "k2", "p3"]


SECRET = "hf_SeCrEt0123456789"
# Prints its arguments as vLLM does at start, then fails quoting one (as argparse does).
TALKATIVE_ENGINE = [
    sys.executable,
    "-c",
    "import sys; print('non-default args:', sys.argv[1:]);"
    "print('ValueError: invalid --hf-token value', sys.argv[sys.argv.index('--hf-token') + 1], '\\x1b[31m');"
    "sys.exit(1)",
]
FAST = SupervisionFields(
    startup_timeout=30, probe_interval=0.2, probe_timeout=0.5, probe_failures=2,
    restart_backoff=0.05, restart_backoff_max=0.2, crash_loop_limit=3, crash_loop_window=60,
    stable_after=60, stop_timeout=5,
)  # fmt: skip


class _RealEngineBackend(ManagedBackendDouble):
    """The admin and health routes over a real supervisor and engine process."""

    def __init__(self, supervisor: EngineSupervisor) -> None:
        super().__init__()
        self.supervisor = supervisor  # type: ignore[assignment]

    def health(self) -> tuple[bool, dict[str, Any]]:
        return False, {"status": str(self.supervisor.state), "reason": self.supervisor.reason}


async def test_an_engine_secret_is_shown_nowhere(tmp_path: Path) -> None:
    def spec(socket_path: Path, api_key: str) -> EngineSpec:
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=TALKATIVE_ENGINE,
            extra_args=["--hf-token", SECRET],
        )  # fmt: skip

    supervisor = EngineSupervisor(spec, cache_dir=tmp_path, timings=FAST)
    backend = _RealEngineBackend(supervisor)
    app = create_app(settings_for(tmp_path, host="127.0.0.1"), backend=backend)
    root = logging.getLogger()
    with _Written(root, SafeFormatter(FORMAT)) as text_log, _Written(root, JsonFormatter()) as js:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://127.0.0.1"
            ) as client,
        ):
            await supervisor.start()
            try:
                deadline = time.monotonic() + 20
                while supervisor.state != EngineState.FAILED:
                    assert time.monotonic() < deadline, supervisor.state
                    await asyncio.sleep(0.05)
                key = {"Authorization": f"Bearer {(tmp_path / 'admin-token').read_text().strip()}"}
                health = await client.get("/health")
                logs = await client.get("/admin/logs", headers=key)
                engine = await client.get("/admin/engine", headers=key)
            finally:
                await supervisor.stop()
        written = text_log.stream.getvalue() + js.stream.getvalue()
    # The engine did print it, and the failure quotes it: the routes hide it.
    assert SECRET in supervisor.log_path.read_text()
    reason = health.json()["reason"]
    assert "invalid --hf-token value *** \\x1b[31m" in reason and "\x1b" not in reason
    assert '"engine"' in logs.text and "non-default args" in logs.text
    assert "spawning engine" in written
    for shown in (health.text, logs.text, engine.text, written):
        assert SECRET not in shown
    assert loggable(f"token {SECRET}") == "token ***"
