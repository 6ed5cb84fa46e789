"""The command line follows the conventions of the tools users know: -h, --version,
--log-level, unknown options refused, the engine's flags after `--` (minus loragate's own),
and vLLM's names for the options that mean the same."""

from __future__ import annotations

import typing
from typing import Any, Literal

import pytest
from typer.testing import CliRunner

from loragate import __version__
from loragate.cli import app

runner = CliRunner()
COMMANDS = [
    [],
    ["serve"],
    ["pull"],
    ["status"],
    ["systemd-unit"],
    ["adapters"],
    ["adapters", "add"],
    ["adapters", "list"],
    ["adapters", "remove"],
    ["adapters", "rollback"],
    ["adapters", "convert"],
    ["cache"],
    ["cache", "list"],
    ["cache", "remove"],
    ["cache", "prune"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "gateway")
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_every_command_has_short_and_long_help(command: list[str], flag: str) -> None:
    result = runner.invoke(app, [*command, flag])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    result = runner.invoke(app, [flag])
    assert result.exit_code == 0
    assert result.output.strip() == f"loragate {__version__}"


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `gateway serve` would start with: load_settings' arguments (nothing starts)."""
    seen: dict[str, Any] = {}

    def load_settings(config: Any, *, from_flags: bool = False, **explicit: Any) -> Any:
        seen.update(explicit)
        raise ValueError("stopped by the test")

    monkeypatch.setattr("loragate.settings.load_settings", load_settings)
    return seen


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-lora", "4"], "No such option: --max-lora"),
        (["--modle", "x"], "No such option: --modle"),
        (["-x"], "No such option: -x"),
        (["org/model", "stray-argument"], "unexpected extra argument"),  # MODEL, then a stray
        (["--gpu-memory-utilization", "0.5"], "No such option"),  # an engine flag before `--`
    ],
)
def test_unknown_options_and_stray_arguments_before_the_separator_are_errors(
    captured: dict[str, Any], args: list[str], says: str
) -> None:
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split())
    assert captured == {}  # refused before anything was read


@pytest.mark.parametrize(
    ("flag", "use"),
    [
        ("--port", "use --port"),
        ("--host", "use --host"),
        ("--served-model-name", "use --model-name"),
        ("--api-key", "use --api-key"),
        ("--lora-modules", "use --lora NAME=SOURCE"),
        ("--max-loras", "use --max-loras"),
        ("--allowed-local-media-path", "use --allowed-media-dir"),
        ("--uds", "not needed"),
        ("--tool-call-parser", "use --tool-call-parser"),
        # vLLM's argparse keeps the last: the engine would serve another model under this name.
        ("--model", "use --model (before `--`"),
    ],
)
def test_loragate_owned_engine_flags_after_the_separator_are_refused_with_the_flag_to_use(
    captured: dict[str, Any], flag: str, use: str
) -> None:
    for form in ([flag, "value"], [f"{flag}=value"]):
        result = runner.invoke(app, ["serve", "--", "--dtype", "float32", *form])
        assert result.exit_code == 2, result.output
        assert f"{flag}: {use}" in result.output
        assert captured == {}


def test_other_engine_flags_after_the_separator_reach_the_engine(captured: dict[str, Any]) -> None:
    engine = ["--dtype", "float32", "--tensor-parallel-size", "2", "--max-model-len", "4096"]
    result = runner.invoke(app, ["serve", "--port", "9000", "--", *engine])
    assert "stopped by the test" in result.output
    assert captured["engine_args"] == engine
    assert captured["port"] == 9000


def test_vllms_names_are_aliases_of_loragates(captured: dict[str, Any]) -> None:
    result = runner.invoke(
        app,
        [
            "serve",
            "--served-model-name", "my-base",
            "--lora-modules", "fox=/adapters/fox",
            "--allowed-local-media-path", "/srv/media",
            "--allowed-origins", "https://app.example",
            "--log-level", "DEBUG",
        ],
    )  # fmt: skip
    assert "stopped by the test" in result.output
    assert captured["model_name"] == "my-base"
    assert captured["lora"] == ["fox=/adapters/fox"]
    assert str(captured["allowed_media_dir"]) == "/srv/media"
    assert captured["cors_origins"] == ["https://app.example"]
    assert captured["log_level"] == "debug"


def test_a_config_file_cannot_set_loragate_owned_engine_flags_either() -> None:
    from loragate.settings import Settings

    with pytest.raises(ValueError, match="--served-model-name: use --model-name"):
        Settings(engine_args=["--served-model-name", "x"])


def _serve_options() -> list[tuple[str, str]]:
    """(field name, first flag) of each generated option (typer keeps an Annotated option's
    first name in ``default``)."""
    from loragate.cli_options import serve_parameters

    options = [(p.name, p.annotation.__metadata__[0]) for p in serve_parameters()]
    return [(name, option.default.split("/")[0]) for name, option in options]


@pytest.mark.parametrize(("name", "flag"), _serve_options(), ids=[n for n, _ in _serve_options()])
def test_each_serve_option_is_the_settings_field_of_its_name(
    captured: dict[str, Any], name: str, flag: str
) -> None:
    """Declared once, in Settings: its help is the field's description, and a value given on
    the command line reaches the settings under the field's name, in the field's type."""
    from loragate.settings import Settings

    field = Settings.model_fields[name]
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "400"}).output
    assert flag in help_text
    assert " ".join((field.description or "").split()[:4]) in " ".join(help_text.split())
    annotation = str(field.annotation)
    if "bool" in annotation:
        args, want = [flag], True
    elif "Literal" in annotation:
        literal = next(
            (a for a in typing.get_args(field.annotation) if typing.get_origin(a) is Literal),
            field.annotation,
        )
        choice = str(typing.get_args(literal)[-1])
        args, want = [flag, choice], choice
    elif "list" in annotation:
        args, want = [flag, "a", flag, "b"], ["a", "b"]
    elif "int" in annotation:
        args, want = [flag, "3"], 3
    elif "float" in annotation:
        args, want = [flag, "2.5"], 2.5
    elif "Path" in annotation:
        args, want = [flag, "/srv/x"], "/srv/x"
    else:
        args, want = [flag, "value"], "value"
    result = runner.invoke(app, ["serve", *args])
    assert "stopped by the test" in result.output, result.output
    given = {key: value for key, value in captured.items() if value is not None}
    assert set(given) == {name}, given
    assert (str(given[name]) if "Path" in annotation else given[name]) == want


def test_no_docs_turns_the_docs_off(captured: dict[str, Any]) -> None:
    runner.invoke(app, ["serve", "--no-docs"])
    assert captured["docs"] is False
