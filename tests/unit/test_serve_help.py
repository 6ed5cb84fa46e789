"""`gateway serve --help` is read by people at 80 columns (and by scripts that grep it): every
option name whole at any width, metavars in words, each option's environment variable, a help
text and the right default; `gateway serve MODEL` as `vllm serve MODEL`; and vLLM's underscore
spellings of the flags loragate owns refused after `--` like the dashed ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from loragate.cli import app
from loragate.settings import Settings

runner = CliRunner()


def _option_params() -> list[Any]:
    """The serve command's options (typer's own click classes: told apart by kind)."""
    group: Any = typer.main.get_command(app)
    command = group.commands["serve"]
    ctx = command.make_context("serve", [], resilient_parsing=True)
    return [p for p in command.get_params(ctx) if p.param_type_name == "option"]


def _names(param: Any) -> list[str]:
    return [*param.opts, *param.secondary_opts]


def _settings_options() -> list[Any]:
    """The options that are Settings fields (the serve-option walk)."""
    return [p for p in _option_params() if p.name in Settings.model_fields]


def _help(columns: int, *command: str) -> str:
    env = {"COLUMNS": str(columns), "TERMINAL_WIDTH": str(columns)}
    result = runner.invoke(app, [*(command or ("serve",)), "--help"], env=env)
    assert result.exit_code == 0, result.output
    return result.output


def _blocks(text: str) -> dict[str, str]:
    """Each option's block of the help (its name lines and the help beneath), by every name."""
    blocks: dict[str, str] = {}
    current: list[str] = []
    for line in [*text.splitlines(), ""]:
        if re.match(r"^  -", line) or not line.startswith("  "):
            if current:
                block = "\n".join(current)
                for name in re.findall(r"(?<![\w-])(--?[\w][\w-]*)", current[0]):
                    blocks.setdefault(name, block)
            current = [line] if line.startswith("  -") else []
        elif current:
            current.append(line)
    return blocks


def _whole(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.parametrize("columns", [60, 80, 100])
def test_no_option_name_is_cut_and_no_line_is_wider_than_the_terminal(columns: int) -> None:
    text = _help(columns)
    for param in _option_params():
        for name in _names(param):
            assert _whole(name, text), f"{name} is not whole at {columns} columns:\n{text}"
    assert "…" not in text
    too_wide = [line for line in text.splitlines() if len(line) > columns]
    assert too_wide == []


def test_every_settings_option_shows_its_environment_variable_in_its_own_block() -> None:
    blocks = _blocks(_help(80))
    for param in _settings_options():
        assert param.name is not None
        block = blocks[param.opts[0]]
        assert "[env: " in block, block
        assert f"LORAGATE_{param.name.upper()}" in " ".join(block.split()), block
    assert "DATATURE_VI_SECRET_KEY" in blocks["--secret-key"]


def _name_line(block: str) -> str:
    return " ".join(line for line in block.splitlines() if line.startswith("  -")).strip()


def test_metavars_are_words_and_flags_take_none() -> None:
    text = _help(80)
    for python_type in ("<list[str]>", "<bool>", "<str>", "<int>", "<float>", "<path>"):
        assert python_type not in text
    blocks = _blocks(text)
    first_lines = {name: block.splitlines()[0].strip() for name, block in blocks.items()}
    assert first_lines["--max-loras"] == "--max-loras INT"
    assert first_lines["--lora"].endswith("NAME=SOURCE")
    assert first_lines["--header-timeout"] == "--header-timeout SECONDS"
    assert first_lines["--upstream-timeout"] == "--upstream-timeout SECONDS"
    assert first_lines["--max-body-bytes"] == "--max-body-bytes BYTES"
    assert first_lines["--upstream-url"] == "--upstream-url URL"
    assert first_lines["--cache-dir"] == "--cache-dir PATH"
    assert first_lines["--host"] == "--host TEXT"
    assert first_lines["--open-admin"] == "--open-admin"
    assert first_lines["--docs"] == "--docs, --no-docs"
    assert first_lines["--log-json"] == "--log-json"
    assert first_lines["--log-level"] == "--log-level {debug,info,warning,error,critical}"
    assert _name_line(blocks["--distributed-executor-backend"]).endswith(
        "{mp,ray,uni,external_launcher}"
    )


def test_every_option_has_help_text_and_config_too() -> None:
    blocks = _blocks(_help(80))
    for param in _option_params():
        block = blocks[param.opts[0]]
        beneath = [line for line in block.splitlines()[1:] if not line.startswith("  -")]
        words = " ".join(beneath).replace("[env:", "").split()
        assert len(words) >= 3, f"{param.opts[0]} has no help:\n{block}"
    assert "TOML or YAML" in blocks["--config"]


def test_defaults_are_shown_whole() -> None:
    blocks = {name: " ".join(block.split()) for name, block in _blocks(_help(80)).items()}
    assert "(default: 8000)" in blocks["--port"]
    assert "(default: 127.0.0.1)" in blocks["--host"]
    assert "(default: 32 MiB)" in blocks["--max-body-bytes"]
    assert "(default: 64 KiB)" in blocks["--max-header-bytes"]
    assert "(default: 10)" in blocks["--header-timeout"]
    assert "(default: info)" in blocks["--log-level"]
    assert "(default: on)" in blocks["--docs"]
    assert "(default: " in blocks["--cache-dir"]  # computed: ~/.cache/loragate or XDG's
    assert "loragate" in blocks["--cache-dir"]


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (("pull",), "(default: ~/.cache/loragate)"),
        (("status",), "(default: a gateway on this machine's per-start token)"),
        (("adapters", "convert"), "(default: ~/.cache/loragate)"),
    ],
)
def test_other_commands_keep_their_bracketed_defaults(command: tuple[str, ...], says: str) -> None:
    """rich read "[default: ...]" as markup and printed "Cache dir ." instead."""
    text = " ".join(_help(120, *command).split())
    assert says in text
    assert " ." not in text.replace("...", "")


def test_options_come_in_named_sections() -> None:
    text = _help(80)
    headings = [line[:-1] for line in text.splitlines() if re.fullmatch(r"[A-Z][\w ]+:", line)]
    for section in ("Model", "Adapters", "Network and keys", "Engine", "Limits", "Logging"):
        assert section in headings, headings
    blocks_at = {name: text.index(block) for name, block in _blocks(text).items()}

    def section_of(name: str) -> str:
        before = text[: blocks_at[name]]
        return [h for h in headings if f"\n{h}:\n" in before][-1] if headings else ""

    assert section_of("--model") == "Model"
    assert section_of("--lora") == "Adapters"
    assert section_of("--api-key") == "Network and keys"
    assert section_of("--tensor-parallel-size") == "Engine"
    assert section_of("--max-body-bytes") == "Limits"
    assert section_of("--log-level") == "Logging"


def test_the_console_script_at_80_columns_shows_every_name_whole() -> None:
    script = Path(sys.executable).with_name("gateway")
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("TERMINAL_WIDTH", None)
    done = subprocess.run(
        [str(script), "serve", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for param in _option_params():
        for name in _names(param):
            assert _whole(name, done.stdout), name
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    assert "[env: LORAGATE_MAX_LORAS]" in done.stdout


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `gateway serve` started: its settings and the app its server was given (nothing
    listens: ``serve_app`` is replaced)."""
    import loragate.gateway.app as gateway_app
    import loragate.gateway.server.serve as server

    seen: dict[str, Any] = {}
    real_create_app = gateway_app.create_app

    def create_app(settings: Settings, *args: Any, **kwargs: Any) -> Any:
        seen["settings"] = settings
        return real_create_app(settings, *args, **kwargs)

    monkeypatch.setattr(gateway_app, "create_app", create_app)
    monkeypatch.setattr(server, "serve_app", lambda asgi, settings: seen.setdefault("app", asgi))
    return seen


UPSTREAM = ["--upstream-url", "http://127.0.0.1:9/v1", "--port", "0"]


def test_serve_takes_the_model_as_its_argument_like_vllm_serve(
    started: dict[str, Any], tmp_path: Path
) -> None:
    result = runner.invoke(
        app, ["serve", "org/some-model", *UPSTREAM, "--cache-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert started["settings"].model == "org/some-model"
    assert "app" in started


def test_the_model_given_both_ways_alike_is_fine(started: dict[str, Any], tmp_path: Path) -> None:
    args = ["serve", "org/m", "--model", "org/m", *UPSTREAM, "--cache-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert started["settings"].model == "org/m"


def test_the_model_given_both_ways_differently_is_a_one_line_usage_error(
    started: dict[str, Any],
) -> None:
    result = runner.invoke(app, ["serve", "org/a", "--model", "org/b", *UPSTREAM])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "org/a" in lines[0] and "org/b" in lines[0] and "--model" in lines[0]
    assert started == {}


def test_a_second_argument_is_still_an_error(started: dict[str, Any]) -> None:
    result = runner.invoke(app, ["serve", "org/a", "stray", *UPSTREAM])
    assert result.exit_code == 2
    assert "unexpected extra argument" in " ".join(result.output.split())
    assert started == {}


@pytest.mark.parametrize(
    ("engine_args", "says"),
    [
        (["--max_loras", "4"], "--max_loras: use --max-loras"),
        (["--served_model_name=x"], "--served_model_name: use --model-name"),
        (["--max_lora_rank=64"], "--max_lora_rank: use --max-lora-rank"),
        (["--enable_lora"], "--enable_lora: not needed"),
        (["--lora_modules", "a=/x"], "--lora_modules: use --lora NAME=SOURCE"),
    ],
)
def test_vllms_underscore_spellings_of_owned_flags_are_refused_after_the_separator(
    started: dict[str, Any], engine_args: list[str], says: str
) -> None:
    result = runner.invoke(app, ["serve", *UPSTREAM, "--", "--dtype", "float32", *engine_args])
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert started == {}


def test_underscore_spellings_count_for_the_parallel_layout_too() -> None:
    layout = Settings(engine_args=["--tensor_parallel_size", "2"]).parallel
    assert layout.tensor == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size is 4"):
        Settings(tensor_parallel_size=4, engine_args=["--tensor_parallel_size=2"])


def test_every_section_and_metavar_override_names_a_serve_option() -> None:
    from loragate.cli_options import METAVAR_OF, PANEL_OF, PANELS

    options = {p.name for p in _settings_options()}
    assert set(PANEL_OF) <= options
    assert set(METAVAR_OF) <= options
    assert set(PANEL_OF.values()) <= set(PANELS)
