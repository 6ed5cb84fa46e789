"""The demo is an explicit command: `gateway demo` builds (cached) and serves it, `gateway serve`
without a model is a one-line usage error that starts nothing, and an embedded gateway with no
model refuses as clearly. A systemd unit whose environment file went missing must fail, not
build and train the demo on a production machine."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

import loragate
from loragate.cli import app
from loragate.cli_serve import DEMO_LEAVES_OUT, NO_MODEL
from loragate.plan.engine_plan import NoModelError, plan_engine
from loragate.settings import Settings
from tests.gateway_process import GatewayProcess
from tools.harness import names_a_model

runner = CliRunner()


class _Reached(Exception):
    """Raised by a stand-in for create_app: the command got as far as building the app."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("reached create_app")
        self.settings = settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """No LORAGATE_* setting from the machine running the tests, and nothing that starts:
    logging stays the test's, preflight and the tool-parser check are not run, and building
    the app raises ``_Reached`` with the settings it was given."""
    for name in list(os.environ):
        if name.startswith("LORAGATE_"):
            monkeypatch.delenv(name)
    started: list[str] = []

    def preflight(**kwargs: Any) -> list[str]:
        started.append("preflight")
        return []

    def create_app(settings: Settings, backend: Any = None) -> Any:
        started.append("create_app")
        raise _Reached(settings)

    monkeypatch.setattr("loragate.logs.configure_logging", lambda *args: None)
    monkeypatch.setattr("loragate.plan.preflight.run_preflight", preflight)
    monkeypatch.setattr("loragate.gateway.app.create_app", create_app)
    monkeypatch.setattr(
        "loragate.plan.tool_parsers.check_tool_parser", lambda *args: started.append("tools")
    )
    return {"started": started}


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "env",
    [{}, {"LORAGATE_DEMO": "tiny"}, {"LORAGATE_PORT": "8123"}],
    ids=["nothing-set", "LORAGATE_DEMO-set", "env-file-without-model"],
)
def test_serve_without_a_model_is_one_line_exit_2_and_starts_nothing(
    clean_env: dict[str, Any], tmp_path: Path, env: dict[str, str]
) -> None:
    cache = tmp_path / "cache"
    result = runner.invoke(app, ["serve", "--cache-dir", str(cache)], env=env)
    assert result.exit_code == 2, result.output
    assert _lines(result.output) == [f"error: {NO_MODEL}"]
    assert clean_env["started"] == []  # no preflight, no tool check, no app
    assert not cache.exists()  # nothing was built or written


def test_serve_without_a_model_in_its_config_file_is_the_same_error(
    clean_env: dict[str, Any], tmp_path: Path
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('port = 8123\nhost = "127.0.0.1"\n')
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert _lines(result.output) == [f"error: {NO_MODEL}"]
    assert clean_env["started"] == []


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--model", "MODEL_DIR"], {}),
        ([], {"LORAGATE_MODEL": "MODEL_DIR"}),
        (["--upstream-url", "http://127.0.0.1:9/v1"], {}),
        (["--run-id", "run-1"], {}),
    ],
    ids=["--model", "LORAGATE_MODEL", "--upstream-url", "--run-id"],
)
def test_serve_with_a_model_from_a_flag_or_the_environment_goes_on(
    clean_env: dict[str, Any], tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    args = [str(model) if arg == "MODEL_DIR" else arg for arg in args]
    env = {name: str(model) if value == "MODEL_DIR" else value for name, value in env.items()}
    argv = ["serve", "--cache-dir", str(tmp_path / "cache"), "--port", "0", *args]
    result = runner.invoke(app, argv, env=env)
    assert isinstance(result.exception, _Reached), result.output
    assert result.exception.settings.demo is None


def test_demo_serves_smollm2_by_default_and_the_tiny_demo_when_asked(
    clean_env: dict[str, Any], tmp_path: Path
) -> None:
    argv = ["demo", "--cache-dir", str(tmp_path), "--port", "0"]
    result = runner.invoke(app, argv)
    assert isinstance(result.exception, _Reached), result.output
    settings = result.exception.settings
    assert (settings.demo, settings.model) == ("smollm2", None)
    assert settings.served_model_name == "smollm2-135m-instruct"
    assert clean_env["started"][-1] == "create_app"
    result = runner.invoke(app, argv, env={"LORAGATE_DEMO": "tiny"})
    assert isinstance(result.exception, _Reached), result.output
    assert result.exception.settings.demo == "tiny"
    assert result.exception.settings.served_model_name == "loragate-demo"


def test_demo_takes_serve_options_and_engine_arguments(
    clean_env: dict[str, Any], tmp_path: Path
) -> None:
    result = runner.invoke(
        app,
        ["demo", "--cache-dir", str(tmp_path), "--port", "0", "--max-loras", "3",
         "--admin-key", "k", "--", "--max-model-len", "512"],
    )  # fmt: skip
    assert isinstance(result.exception, _Reached), result.output
    settings = result.exception.settings
    assert (settings.max_loras, settings.admin_key) == (3, "k")
    assert settings.engine_args == ["--max-model-len", "512"]


@pytest.mark.parametrize(
    "env",
    [
        {"LORAGATE_MODEL": "/srv/models/base"},
        {"LORAGATE_UPSTREAM_URL": "http://127.0.0.1:9/v1"},
        {"LORAGATE_RUN_ID": "run-1"},
    ],
    ids=["model", "upstream_url", "run_id"],
)
def test_demo_refuses_a_model_named_elsewhere(
    clean_env: dict[str, Any], tmp_path: Path, env: dict[str, str]
) -> None:
    result = runner.invoke(app, ["demo", "--cache-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2, result.output
    (line,) = _lines(result.output)
    (variable,) = env
    assert variable in line and "run `gateway serve`" in line
    assert clean_env["started"] == []


def _option_names(command: Any) -> set[str]:
    return {name for param in command.params for name in param.opts if name.startswith("--")}


def test_demo_help_lists_serves_options_but_those_that_choose_the_model() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    serve, demo = commands["serve"], commands["demo"]
    left_out = {
        "--model", "--pretrained-model-name-or-path", "--upstream-url", "--run-id",
        "--secret-key", "--organization-id",
    }  # fmt: skip
    assert _option_names(demo) == _option_names(serve) - left_out
    assert left_out <= _option_names(serve)
    assert not [p for p in demo.params if p.name in DEMO_LEAVES_OUT]
    help_text = runner.invoke(app, ["demo", "--help"], env={"COLUMNS": "80"}).output
    # Options are the lines that start with one ("  --port PORT", "  -h, --help"); help text
    # wrapped beneath them may start with an option's name too, and is not a listing.
    listed = {
        name.rstrip(",")
        for line in help_text.splitlines()
        if line.startswith("  -")
        for name in line.split()[:2]
        if name.startswith("-")
    }
    assert {"--config", "--port", "--host", "--admin-key", "--lora", "--max-loras"} <= listed
    assert not listed & left_out
    listing = runner.invoke(app, ["--help"]).output
    assert "demo" in listing and "Serve the bundled demo" in " ".join(listing.split())


def test_create_server_with_no_model_and_no_backend_refuses(tmp_path: Path) -> None:
    with pytest.raises(NoModelError, match="no model to serve: give model="):
        loragate.create_server(cache_dir=tmp_path)
    # Asked for, the demo is served (nothing starts before the app's lifespan).
    assert loragate.create_server(cache_dir=tmp_path, demo="tiny") is not None


async def test_an_engine_plan_without_a_model_refuses_instead_of_building_the_demo(
    tmp_path: Path,
) -> None:
    with pytest.raises(NoModelError):
        await plan_engine(Settings(cache_dir=tmp_path), tmp_path)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        ([], False),
        (["--port", "1", "--config", "x.yaml"], False),
        (["--model", "m"], True),
        (["--model=m"], True),
        (["--pretrained-model-name-or-path", "m"], True),
        (["--upstream-url", "http://x/v1"], True),
        (["--run-id", "r"], True),
        (["--", "--model", "m"], False),  # an engine flag, not the gateway's
    ],
)
def test_the_harness_runs_serve_only_when_its_arguments_name_a_model(
    args: list[str], names: bool
) -> None:
    assert names_a_model(args) is names


def test_the_harness_boots_gateway_demo_on_a_stand_in_engine(tmp_path: Path) -> None:
    """GatewayProcess without --model starts `gateway demo` (the tiny demo, cached), here in
    front of the instant stand-in engine, as the suite's integration gateways do."""
    config = tmp_path / "gateway.yaml"
    engine = [sys.executable, "-m", "tools.bench.fake_engine"]
    config.write_text(json.dumps({"engine_command": engine}))  # JSON is YAML
    process = GatewayProcess(cache_dir=tmp_path / "cache", args=["--config", str(config)])
    process.start()
    try:
        process.wait_ready(timeout=120)
        assert process.proc is not None and process.proc.args[1] == "demo"
        models = httpx.get(f"{process.url}/v1/models", timeout=10).json()
        assert {"loragate-demo", "pong"} <= {m["id"] for m in models["data"]}
    finally:
        process.stop()
