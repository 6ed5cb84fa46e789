"""The operator's terminal: `gateway chat MODEL` talks to a model as `ollama run` does,
`gateway status` is a table a person reads (and `--json` the report scripts read), shell
completion is on, and every command prints the same plain help. Against a real in-process
gateway over real sockets; nothing boots an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import typer
import typer.main
from starlette.responses import Response, StreamingResponse
from typer.testing import CliRunner

from loragate.cli import app
from loragate.cli_chat import Conversation, converse
from loragate.cli_status import StatusAnswers, status_table
from loragate.http.sse import sse_data, sse_lines
from tests.backend_double import ManagedBackendDouble, app_with, serving, settings_for

runner = CliRunner()
ADMIN_KEY = "admin-key-of-the-test"
INFERENCE_KEY = "inference-key-of-the-test"
PIECES = ["Ahoy", ", ", "matey", "\u2028", "!"]  # a U+2028 inside an event's JSON is text
ANSWER = "".join(PIECES)


class StreamingBackend(ManagedBackendDouble):
    """The managed backend double (admin API answered), whose chat answers stream
    ``PIECES`` one event each, its lines ended in CRLF as sse-starlette ends them."""

    async def forward(
        self, path: str, payload: dict[str, Any], public_model: str, stream: bool, request_id: str
    ) -> Response:
        if not stream:
            return await super().forward(path, payload, public_model, stream, request_id)
        self.forwarded.append((path, dict(payload)))

        async def events() -> AsyncIterator[bytes]:
            for piece in PIECES:
                chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                yield b"data: " + orjson.dumps(chunk) + b"\r\n\r\n"
            yield b"data: [DONE]\r\n\r\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def backend() -> StreamingBackend:
    return StreamingBackend()


@pytest.fixture(scope="module")
def gateway(backend: StreamingBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = settings_for(tmp_path_factory.mktemp("cache"), admin_key=ADMIN_KEY)
    with serving(app_with(backend, settings), as_served=True) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway whose inference routes want a key."""
    settings = settings_for(
        tmp_path_factory.mktemp("keyed"), admin_key=ADMIN_KEY, api_key=[INFERENCE_KEY]
    )
    with serving(app_with(StreamingBackend(), settings), as_served=True) as url:
        yield url


def _chat(url: str, *args: str, stdin: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, ["chat", *args, "--url", url], input=stdin, env=env)


def _error_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# ----- gateway chat ---------------------------------------------------------------------------


def test_chat_streams_each_answer_and_sends_the_conversation_so_far(
    gateway: str, backend: StreamingBackend
) -> None:
    before = len(backend.forwarded)
    result = _chat(
        gateway, "base", "--system", "Talk like a pirate.", "--max-tokens", "32",
        stdin="Hello\nAnd again?\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{ANSWER}\n{ANSWER}\n"  # piped: no prompt, the answers alone
    first, second = [payload for _, payload in backend.forwarded[before:]]
    assert first["stream"] is True and first["max_tokens"] == 32
    assert second["messages"] == [
        {"role": "system", "content": "Talk like a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And again?"},
    ]


def test_the_answer_arrives_piece_by_piece_as_it_streams(gateway: str) -> None:
    with httpx.Client(trust_env=False) as client:
        pieces = list(Conversation(client, gateway, "pong").answer("Hi"))
    assert pieces == PIECES


def test_bye_ends_the_conversation(gateway: str, backend: StreamingBackend) -> None:
    before = len(backend.forwarded)
    result = _chat(gateway, "base", stdin="Hello\n/bye\nnever sent\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{ANSWER}\n"
    assert len(backend.forwarded) == before + 1


def test_piped_into_the_console_script_it_answers_once_and_ends_at_eof(gateway: str) -> None:
    script = Path(sys.executable).with_name("gateway")
    done = subprocess.run(
        [str(script), "chat", "base", "--url", gateway],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LORAGATE_CACHE_DIR": "/nonexistent"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{ANSWER}\n"


def test_a_model_the_gateway_does_not_serve_is_one_error_line_and_exit_1(gateway: str) -> None:
    result = _chat(gateway, "no-such-model", stdin="Hello\n")
    assert result.exit_code == 1
    assert result.stdout == ""
    (line,) = _error_lines(result)
    assert line.startswith("error: 404: ") and "no-such-model" in line


def test_a_wrong_key_is_one_error_line_and_exit_1(keyed_gateway: str) -> None:
    result = _chat(keyed_gateway, "base", "--api-key", "wrong", stdin="Hello\n")
    assert result.exit_code == 1
    (line,) = _error_lines(result)
    assert line.startswith("error: 401: ")


def test_the_key_comes_from_the_variable_the_gateway_reads_or_the_admin_key(
    keyed_gateway: str,
) -> None:
    listed = {"LORAGATE_API_KEY": f"{INFERENCE_KEY},another-key"}
    assert _chat(keyed_gateway, "base", stdin="Hi\n", env=listed).stdout == f"{ANSWER}\n"
    admin = _chat(keyed_gateway, "base", "--admin-key", ADMIN_KEY, stdin="Hi\n")
    assert admin.exit_code == 0, admin.output


def test_an_unreachable_gateway_is_one_error_line_and_exit_1() -> None:
    result = _chat("http://127.0.0.1:9", "base", "--admin-key", "x", stdin="Hello\n")
    assert result.exit_code == 1
    (line,) = _error_lines(result)
    assert line.startswith("error: cannot reach the gateway at http://127.0.0.1:9")


def _lines(*lines: str | BaseException | None) -> Any:
    """A ``read_line`` that gives ``lines`` in turn (raising an exception it is given)."""
    queue = list(lines)

    def read_line() -> str | None:
        item = queue.pop(0) if queue else None
        if isinstance(item, BaseException):
            raise item
        return item

    return read_line


def test_on_a_terminal_an_error_goes_back_to_the_prompt(
    gateway: str, capsys: pytest.CaptureFixture[str]
) -> None:
    shown: list[str] = []
    with httpx.Client(trust_env=False) as client:
        conversation = Conversation(client, gateway, "no-such-model")
        converse(conversation, _lines("Hello", "Hello again"), shown.append, interactive=True)
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 2 and all(line.startswith("error: 404: ") for line in errors)
    assert conversation.messages == []


def test_ctrl_c_during_an_answer_stops_it_and_returns_to_the_prompt(gateway: str) -> None:
    shown: list[str] = []

    def echo(text: str) -> None:
        if text == PIECES[1] and "^C" not in shown:  # the user presses Ctrl-C mid-answer
            shown.append("^C")
            raise KeyboardInterrupt
        shown.append(text)

    with httpx.Client(trust_env=False) as client:
        conversation = Conversation(client, gateway, "base")
        converse(conversation, _lines("Stop me", "Go on"), echo, interactive=True)
    # The stopped turn is dropped; the next one streams whole on the same client.
    assert conversation.messages == [
        {"role": "user", "content": "Go on"},
        {"role": "assistant", "content": ANSWER},
    ]
    assert "".join(shown).endswith(f"{ANSWER}\n\n")


def test_piped_a_ctrl_c_ends_the_command_as_an_interrupt(gateway: str) -> None:
    def echo(text: str) -> None:
        if text in PIECES:  # the user presses Ctrl-C as the answer starts
            raise KeyboardInterrupt

    with httpx.Client(trust_env=False) as client:
        conversation = Conversation(client, gateway, "base")
        with pytest.raises(typer.Exit) as stopped:
            converse(conversation, _lines("Hello", "never read"), echo, interactive=False)
    assert stopped.value.exit_code == 130
    assert conversation.messages == []


def test_ctrl_c_at_the_prompt_says_how_to_leave_and_ctrl_d_leaves(gateway: str) -> None:
    shown: list[str] = []
    with httpx.Client(trust_env=False) as client:
        conversation = Conversation(client, gateway, "base")
        converse(conversation, _lines(KeyboardInterrupt(), None), shown.append, interactive=True)
    assert "Ctrl-D or /bye" in "".join(shown)


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_events_are_read_whatever_ends_their_lines(end: bytes) -> None:
    text = end.join([b'data: {"a": "x\xe2\x80\xa8y"}', b"", b": a comment", b"data: 1", b"data: 2"])
    stream = text + end + end + b"data: [DONE]" + end + end
    for size in (1, 2, 7, len(stream)):  # every cut, a CRLF's halves in two chunks included
        chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert list(sse_data(sse_lines(chunks))) == ['{"a": "x\u2028y"}', "1\n2", "[DONE]"]


# ----- gateway status -------------------------------------------------------------------------


def _status(url: str, *args: str) -> Any:
    result = runner.invoke(
        app, ["status", "--url", url, "--admin-key", ADMIN_KEY, *args], env={"COLUMNS": "80"}
    )
    assert result.exit_code == 0, result.output
    return result


def test_status_is_a_table_of_the_gateway_its_engine_models_and_adapters(gateway: str) -> None:
    text = _status(gateway).stdout
    lines = text.splitlines()
    assert lines[0].split() == ["GATEWAY", "STATUS", "UPTIME", "IN", "FLIGHT", "WAITING"]
    assert lines[1].split()[:2] == [gateway, "healthy"]
    engine = lines.index(next(line for line in lines if line.startswith("ENGINE")))
    assert lines[engine + 1].split()[:2] == ["base", "ready"]
    model = lines.index(next(line for line in lines if line.startswith("MODEL")))
    assert lines[model + 1].split() == ["base", "ready", "0", "1"]
    assert any(line.split()[:3] == ["pong@000000000000", "base", "serving"] for line in lines)
    assert max(len(line) for line in lines) <= 80
    assert "{" not in text  # no JSON


def test_status_json_is_the_admin_apis_report_as_it_always_was(gateway: str) -> None:
    report = json.loads(_status(gateway, "--json").stdout)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    engine = httpx.get(f"{gateway}/admin/engine", headers=headers).json()
    adapters = httpx.get(f"{gateway}/admin/adapters", headers=headers).json()
    engine.pop("log_tail", None)
    assert report == {"engine": engine, "adapters": adapters["data"]}


def test_status_of_a_catalog_shows_each_model_its_residency_and_why_one_failed() -> None:
    engine = {"state": "ready", "pid": 4242, "restarts": 1, "uptime_s": 7980.0,
              "rss_bytes": 3 << 30, "reason": "engine answers /health", "last_exit": None}  # fmt: skip
    cold = {**engine, "state": "stopped", "pid": None, "uptime_s": None, "rss_bytes": None}
    failed = {**cold, "state": "failed", "reason": "CUDA out of memory " * 8}

    def model(id_: str, residency: str, **values: Any) -> dict[str, Any]:
        row = {"id": id_, "residency": residency, "state": "ready", "reason": None,
               "adapters": [], "memory_bytes": None, "in_flight": 0, "idle_seconds": 3.0}  # fmt: skip
        return {**row, **values}

    support = {"name": "support", "version": "ab" * 32, "state": "ready",
               "source": "/srv/adapters/support", "base_model": "qwen"}  # fmt: skip
    adding = {"name": "billing", "stage": "download", "finished": False,
              "bytes_done": 1 << 20, "bytes_total": 4 << 20, "percent": 25.0}  # fmt: skip
    answers = StatusAnswers(
        engine={"qwen": engine, "llama": cold, "mistral": failed},
        adapters={
            "base_models": ["qwen", "llama", "mistral"],
            "data": [support],
            "progress": [adding],
        },
        catalog={
            "models": [
                model("qwen", "serving", adapters=["support"], in_flight=2, memory_bytes=3 << 30),
                model("llama", "cold", state="stopped", idle_seconds=4000.0),
                model("mistral", "failed", state="failed", reason=failed["reason"]),
            ],
            "swaps": 5,
        },
    )
    health = {"status": "degraded", "reason": "mistral: CUDA out of memory", "uptime_s": 90000}
    text = status_table("http://127.0.0.1:8000", answers, health, {"in_flight": 2, "queued": 0})
    rows = [line.split() for line in text.splitlines()]
    assert rows[1][:3] == ["http://127.0.0.1:8000", "degraded", "1d1h"]
    assert "mistral: CUDA out of memory" in text
    assert ["qwen", "ready", "4242", "1", "2h13m", "3.0", "GiB"] in rows  # the engine
    assert ["qwen", "serving", "ready", "2", "3s", "3.0", "GiB", "1"] in rows  # the model
    assert ["llama", "cold", "stopped", "0", "1h06m", "-", "0"] in rows
    assert "swaps: 5" in text
    assert f"support@{'ab' * 6}" in text
    assert "adding billing: download 25% (1.0 MiB of 4.0 MiB)" in text
    assert max(len(line) for line in text.splitlines()) <= 80  # the reason wraps, whole


# ----- completion and help --------------------------------------------------------------------


def test_shell_completion_is_on() -> None:
    """The script a shell sources (what --install-completion writes) and a completion, asked
    as bash asks it. Not --show-completion: that detects the shell running the tests, and
    pytest may have none above it (.ci/run execs it; a container or a service runs it)."""
    assert "--install-completion" in runner.invoke(app, ["--help"]).stdout
    script = runner.invoke(app, [], env={"_GATEWAY_COMPLETE": "source_bash"}, prog_name="gateway")
    assert script.exit_code == 0 and "_GATEWAY_COMPLETE=complete_bash" in script.stdout
    asked = {"_GATEWAY_COMPLETE": "complete_bash", "COMP_WORDS": "gateway ser", "COMP_CWORD": "1"}
    completed = runner.invoke(app, [], env=asked, prog_name="gateway")
    assert completed.exit_code == 0 and completed.stdout.split() == ["serve"], completed.stdout


def _commands() -> list[list[str]]:
    found: list[list[str]] = []

    def walk(words: list[str], command: Any) -> None:
        found.append(words)
        for name, sub in getattr(command, "commands", {}).items():
            walk([*words, name], sub)

    walk([], typer.main.get_command(app))
    return found


@pytest.mark.parametrize("command", _commands(), ids=lambda words: " ".join(words) or "gateway")
def test_every_command_prints_the_same_plain_help_at_80_columns(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("Usage: ")
    assert not any(mark in text for mark in ("╭", "│", "…", "<str>", "<bool>", "<path>", "<int>"))
    assert "{" not in text.splitlines()[0]  # arguments in words: NAME, not {name}
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "  -h, --help\n      Show this message and exit." in text
