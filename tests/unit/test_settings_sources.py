"""Settings read the way operators of vLLM, Ollama or llama-swap write them, and fail in one
line naming where the bad value came from: list settings take a plain value, a
comma-separated list or JSON (environment and config file alike); a wrong value names its
``LORAGATE_*`` variable, flag or ``file:line``; an unknown key gets the nearest valid one;
``LORAGATE_CONFIG`` names the file; ``VLLM_API_KEY`` closes the inference routes as in vLLM;
exit code 2 is a usage error, 1 a failure at run time."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner, Result

from loragate import cli
from loragate.settings import Settings, SettingsError, config_schema, load_settings
from tests.backend_double import free_port

CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting from the machine running the tests."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("LORAGATE_") or name == "VLLM_API_KEY":
            monkeypatch.delenv(name)


def serve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str
) -> tuple[Result, dict[str, Any]]:
    """`gateway serve` for real up to its server (which receives the app instead)."""
    captured: dict[str, Any] = {}
    monkeypatch.setattr(
        "loragate.gateway.server.serve.serve_app", lambda app, settings: captured.update(app=app)
    )
    monkeypatch.setattr("gc.freeze", lambda: None)
    result = CliRunner().invoke(
        cli.app,
        [
            "serve",
            "--upstream-url", "http://127.0.0.1:9/v1",  # no engine to boot
            "--port", str(free_port()),
            "--cache-dir", str(tmp_path / "cache"),
            *args,
        ],
    )  # fmt: skip
    return result, captured


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# --- list settings: a plain value, a comma-separated list, or JSON ---------------------------

LIST_VALUES = [
    ("api_key", "k1", ["k1"]),
    ("api_key", "k1,k2", ["k1", "k2"]),
    ("api_key", '["k,1"]', ["k,1"]),  # JSON keeps a comma inside a value
    ("lora", "support=/srv/x", ["support=/srv/x"]),
    ("lora", "a=/srv/a, b=hf://org/b@v2", ["a=/srv/a", "b=hf://org/b@v2"]),
    ("lora", "a=https://h.example/a.tar?x=1,2", ["a=https://h.example/a.tar?x=1,2"]),
    ("cors_origins", "https://a.example,https://b.example", ["https://a.example", "https://b.example"]),
    ("allowed_hosts", '["a.com", "b.com"]', ["a.com", "b.com"]),
    ("allowed_hosts", "a.com,b.com", ["a.com", "b.com"]),
    ("engine_args", "--dtype float32 --max-model-len 4096", ["--dtype", "float32", "--max-model-len", "4096"]),
    ("engine_args", '["--dtype", "float32"]', ["--dtype", "float32"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value", "expected"), LIST_VALUES)
def test_a_list_variable_takes_a_plain_value_a_comma_list_or_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, expected: list[str]
) -> None:
    monkeypatch.setenv(f"LORAGATE_{name.upper()}", value)
    assert getattr(load_settings(cache_dir=tmp_path), name) == expected


@pytest.mark.parametrize(("name", "value", "expected"), LIST_VALUES)
@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_list_key_in_the_config_file_takes_the_same_forms(
    tmp_path: Path, name: str, value: str, expected: list[str], suffix: str
) -> None:
    config = tmp_path / f"gateway{suffix}"
    key = name.replace("_", "-")
    config.write_text(
        f"{key} = {json.dumps(value)}\n" if suffix == ".toml" else f"{key}: {json.dumps(value)}\n"
    )
    assert getattr(load_settings(config, cache_dir=tmp_path), name) == expected


def test_gateway_serve_starts_with_one_key_in_loragate_api_key_and_the_key_closes_the_api(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAGATE_API_KEY", "k1")
    monkeypatch.setenv("LORAGATE_LORA", "support=/srv/x")
    result, captured = serve(monkeypatch, tmp_path)
    assert result.exit_code == 0, result.output
    client = TestClient(captured["app"])
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 401
    answer = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k1"})
    assert answer.status_code != 401


def test_an_empty_key_variable_is_refused_not_dropped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAGATE_API_KEY", " ")
    result, _ = serve(monkeypatch, tmp_path)
    assert result.exit_code == 2
    assert "an API key is empty" in result.stderr


# --- one line naming the source ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value", "line"),
    [
        ("LORAGATE_MAX_LORAS", "abc", "LORAGATE_MAX_LORAS: not an integer: 'abc'"),
        ("LORAGATE_MAX_LORAS", "0", "LORAGATE_MAX_LORAS: must be at least 1: '0'"),
        ("LORAGATE_PROBE_TIMEOUT", "soon", "LORAGATE_PROBE_TIMEOUT: not a number: 'soon'"),
        ("LORAGATE_DEEP_PROBE", "maybe", "LORAGATE_DEEP_PROBE: not true or false: 'maybe'"),
        ("LORAGATE_LOG_LEVEL", "loud", "LORAGATE_LOG_LEVEL: must be 'debug', 'info', 'warning', 'error' or 'critical': 'loud'"),
        ("LORAGATE_ENGINE_ARGS", "[--dtype", "LORAGATE_ENGINE_ARGS: not a JSON list"),
    ],
)  # fmt: skip
def test_a_bad_variable_is_one_line_naming_the_variable_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, variable: str, value: str, line: str
) -> None:
    monkeypatch.setenv(variable, value)
    result, captured = serve(monkeypatch, tmp_path)
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {line}")
    assert "app" not in captured


def test_settings_errors_say_each_source_through_settings_directly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('# comment\nmodel = "m"\nmax-lora-rank = "big"\n')
    monkeypatch.setenv("LORAGATE_MAX_LORAS", "abc")
    with pytest.raises(SettingsError) as raised:
        load_settings(config, port="eighty")
    assert sorted(raised.value.problems) == sorted(
        [
            "LORAGATE_MAX_LORAS: not an integer: 'abc'",
            f"{config}:3: not an integer: 'big'",
            "port: not an integer: 'eighty'",
        ]
    )


def test_an_unknown_keyword_names_the_nearest_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings(cache_dir=tmp_path, max_lora=4)
    assert raised.value.problems == ["unknown setting 'max_lora'; did you mean 'max_loras'?"]


def test_a_bad_value_in_the_config_file_names_the_file_and_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, text in [
        ("gateway.toml", 'model = "m"\n\nmax-loras = "many"\n'),
        ("gateway.yaml", "model: m\n\nmax_loras: many\n"),
    ]:
        config = tmp_path / name
        config.write_text(text)
        result, _ = serve(monkeypatch, tmp_path, "--config", str(config))
        assert result.exit_code == 2, result.output
        assert error_lines(result) == [f"error: {config}:3: not an integer: 'many'"]


def test_a_bad_flag_value_checked_by_the_settings_names_the_flag(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        cli.app, ["serve", "--upstream-url", "ftp://x", "--cache-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: --upstream-url: upstream_url must be")


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("gateway.toml", 'model = "m"\nmax_lora = 4\n', ":2: unknown key 'max_lora'; did you mean 'max_loras'?"),
        ("gateway.toml", 'model = "m"\n\n\nmax-lora = 4\n', ":4: unknown key 'max-lora'; did you mean 'max-loras'?"),
        ("gateway.yaml", "model: m\nmax-lora-rnak: 4\n", ":2: unknown key 'max-lora-rnak'; did you mean 'max-lora-rank'?"),
        ("gateway.yaml", "zzzz: 1\n", ":1: unknown key 'zzzz'"),
    ],
)  # fmt: skip
def test_an_unknown_config_key_names_the_file_line_and_the_nearest_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, text: str, line: str
) -> None:
    config = tmp_path / name
    config.write_text(text)
    result, _ = serve(monkeypatch, tmp_path, "--config", str(config))
    assert result.exit_code == 2, result.output
    assert error_lines(result) == [f"error: {config}{line}"]


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("gateway.yaml", "model: m\nlora: [a=/x\nport: 1\n", ":3: "),
        ("gateway.yaml", "model: m\n  port: 1\n", ":2: mapping values are not allowed here"),
        ("gateway.toml", 'model = "m"\nport 8000\n', ":2: Expected '=' after a key"),
        ("gateway.toml", "- 1\n", ":1: "),
        ("gateway.yaml", "- a\n- b\n", ": the config file must hold a table of settings, not a list"),
    ],
)  # fmt: skip
def test_a_config_file_that_does_not_parse_is_one_line_with_its_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, text: str, line: str
) -> None:
    config = tmp_path / name
    config.write_text(text)
    result, _ = serve(monkeypatch, tmp_path, "--config", str(config))
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {config}{line}")
    assert "Traceback" not in result.output


def test_a_missing_config_file_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "absent.toml"
    result, _ = serve(monkeypatch, tmp_path, "--config", str(missing))
    assert result.exit_code == 2
    assert error_lines(result) == [
        f"error: {missing}: cannot read the config file: No such file or directory"
    ]


def test_loragate_config_names_the_config_file_when_no_config_flag_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text("max-loras = 5\n")
    monkeypatch.setenv("LORAGATE_CONFIG", str(config))
    assert load_settings(cache_dir=tmp_path).max_loras == 5
    config.write_text("max-lora = 5\n")
    result, _ = serve(monkeypatch, tmp_path)
    assert result.exit_code == 2
    assert error_lines(result) == [
        f"error: {config}:1: unknown key 'max-lora'; did you mean 'max-loras'?"
    ]
    other = tmp_path / "other.toml"  # --config wins over the variable
    other.write_text("max-loras = 3\n")
    assert load_settings(other, cache_dir=tmp_path).max_loras == 3


def test_a_loragate_variable_that_nearly_names_a_setting_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAGATE_MAX_LORA", "4")
    monkeypatch.setenv("LORAGATE_URL", "http://127.0.0.1:8000")  # the admin commands' own
    result, _ = serve(monkeypatch, tmp_path)
    assert result.exit_code == 0, result.output
    warnings = [line for line in error_lines(result) if line.startswith("warning:")]
    assert warnings == [
        "warning: LORAGATE_MAX_LORA is not a setting and is ignored; did you mean "
        "LORAGATE_MAX_LORAS?"
    ]


# --- the config file's JSON schema -------------------------------------------------------------


def test_the_config_schema_command_prints_a_schema_that_checks_config_files() -> None:
    result = CliRunner().invoke(cli.app, ["config-schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema == json.loads(json.dumps(config_schema()))
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert set(Settings.model_fields) <= set(schema["properties"])
    readme_example = {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "max-loras": 4,
        "lora": ["support=/data/adapters/support-v3"],
        "admin-key": "change-me",
        "api_key": "k1,k2",
    }
    assert list(validator.iter_errors(readme_example)) == []
    wrong = {"max_lora": 4, "max-loras": 0, "log-level": "loud"}
    assert {error.validator for error in validator.iter_errors(wrong)} == {
        "additionalProperties",
        "minimum",
        "enum",
    }


# --- VLLM_API_KEY --------------------------------------------------------------------------


def test_vllm_api_key_is_the_inference_key_when_no_key_setting_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    settings = load_settings(cache_dir=tmp_path)
    assert settings.api_key == ["from-vllm"] and settings.key_from_vllm_env
    result, captured = serve(monkeypatch, tmp_path, "--log-level", "info")
    assert result.exit_code == 0, result.output
    assert "inference API key: VLLM_API_KEY" in result.stderr
    assert "from-vllm" not in result.output
    client = TestClient(captured["app"])
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 401
    headers = {"Authorization": "Bearer from-vllm"}
    assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code != 401


def test_vllm_api_key_gives_way_to_loragates_own_key_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    key_file = tmp_path / "keys"
    key_file.write_text("from-file\n")
    assert load_settings(cache_dir=tmp_path, api_key=["flag"]).api_key == ["flag"]
    from_file = load_settings(cache_dir=tmp_path, api_key_file=key_file)
    assert from_file.inference_keys() == ["from-file"] and not from_file.key_from_vllm_env
    monkeypatch.setenv("LORAGATE_API_KEY", "own")
    assert load_settings(cache_dir=tmp_path).api_key == ["own"]


# --- exit codes: 2 for usage, 1 at run time ------------------------------------------------


def test_a_taken_port_is_a_failure_at_run_time_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(
            cli.app,
            ["serve", "--upstream-url", "http://127.0.0.1:9/v1", "--port", port,
             "--cache-dir", str(tmp_path)],
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "already in use" in result.stderr


def test_an_unreachable_gateway_is_exit_1_and_a_bad_flag_exit_2(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    for command in (["status"], ["adapters", "list"]):
        result = CliRunner().invoke(cli.app, [*command, "--url", closed, "--admin-key", "k"])
        assert result.exit_code == 1, result.output
        assert "cannot reach the gateway" in result.stderr
    assert CliRunner().invoke(cli.app, ["status", "--no-such-flag"]).exit_code == 2


@pytest.fixture
def refusing_gateway() -> Iterator[str]:
    """An HTTP server that refuses every admin call as a gateway does: a 403."""

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"error": {"message": "not the admin key", "type": "x"}}).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_admin_call_the_gateway_refuses_is_exit_1(refusing_gateway: str) -> None:
    result = CliRunner().invoke(
        cli.app, ["adapters", "list", "--url", refusing_gateway, "--admin-key", "wrong"]
    )
    assert result.exit_code == 1, result.output
    assert error_lines(result) == ["error: 403: not the admin key"]
