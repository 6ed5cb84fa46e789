"""Tool calling with one flag: parser names checked against vLLM, picked per model family."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.plan.tool_parsers import (
    FALLBACK_PARSER,
    FAMILY_PARSERS,
    PARSER_TOKENS,
    VLLM_032_TOOL_PARSERS,
    ToolParserError,
    _registered_names,
    check_tool_parser,
    pick_tool_parser,
    tokenizer_vocabulary,
    tool_call_parser,
)
from tests.backend_double import free_port

TOOLS_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def model_dir(tmp_path: Path, model_type: str, template: str | None) -> tuple[Path, dict[str, str]]:
    config = {"model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer = {"chat_template": template} if template is not None else {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return tmp_path, config


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_checked_list_is_the_installed_vllms_registry() -> None:
    from vllm.tool_parsers import ToolParserManager

    registered = frozenset(ToolParserManager.list_registered())
    assert registered == VLLM_032_TOOL_PARSERS
    assert _registered_names(sys.executable) == registered  # read without importing vLLM


def test_every_family_parser_is_one_vllm_knows() -> None:
    assert set(FAMILY_PARSERS.values()) <= VLLM_032_TOOL_PARSERS


def test_a_known_family_with_a_tools_template_gets_its_parser(tmp_path: Path) -> None:
    directory, config = model_dir(tmp_path, "qwen2", TOOLS_TEMPLATE)
    parser, why = pick_tool_parser(directory, config)
    assert parser == "hermes"
    assert "qwen2" in why
    assert tool_call_parser(None, directory, config, [], sys.executable) == "hermes"


def test_pythonic_without_a_tools_template_or_a_known_family(tmp_path: Path) -> None:
    directory, config = model_dir(tmp_path, "qwen2", "{{ messages }}")
    assert pick_tool_parser(directory, config)[0] is None
    directory, config = model_dir(tmp_path, "mystery", TOOLS_TEMPLATE)
    assert pick_tool_parser(directory, config)[0] is None
    # vLLM 0.32 wants a parser even for a named tool_choice: pythonic fits any model.
    assert tool_call_parser(None, directory, config, [], sys.executable) == FALLBACK_PARSER


def test_the_flag_wins_and_the_users_engine_args_win_over_it(tmp_path: Path) -> None:
    directory, config = model_dir(tmp_path, "llama", None)
    assert tool_call_parser("pythonic", directory, config, [], sys.executable) == "pythonic"
    own = ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]
    assert tool_call_parser("pythonic", directory, config, own, sys.executable) is None
    assert tool_call_parser("none", directory, config, [], sys.executable) is None


def test_an_unknown_parser_name_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ToolParserError, match="hermes"):
        check_tool_parser("no-such-parser")


def test_serve_refuses_an_unknown_parser_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serve sets up logging first; left to it, CliRunner's closed stream would stay the
    # handler of every later test's log lines.
    monkeypatch.setattr("loragate.logs.configure_logging", lambda *args: None)
    result = CliRunner().invoke(
        cli_app,
        [
            "demo",  # no model to name: the parser is refused before the demo is built
            "--tool-call-parser",
            "no-such-parser",
            "--port",
            str(free_port()),
            "--cache-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 2
    assert "llama3_json" in result.output


def test_a_family_parser_whose_tokens_the_tokenizer_lacks_is_not_picked(tmp_path: Path) -> None:
    """A Llama-family model with a tools template of its own (like the tiny demo's) and no
    ``<|python_tag|>``: vLLM would refuse to start with llama3_json, so pythonic it is."""
    directory, config = model_dir(tmp_path, "llama", TOOLS_TEMPLATE)
    tokenizer = {"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": "<|im_end|>"}]}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    parser, why = pick_tool_parser(directory, config)
    assert parser is None and "<|python_tag|>" in why
    tokenizer["added_tokens"].append({"content": "<|python_tag|>"})  # type: ignore[attr-defined]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert pick_tool_parser(directory, config)[0] == "llama3_json"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_token_table_is_what_vllms_parsers_need(demo_dir: Path) -> None:
    """Built against a tokenizer with none of their special tokens (the tiny demo's), exactly
    the family parsers listed in PARSER_TOKENS refuse, as vLLM does when the engine starts."""
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "base")
    vocabulary = tokenizer_vocabulary(demo_dir / "base")
    assert vocabulary is not None and "<|im_end|>" in vocabulary
    refused = set()
    for name in sorted(set(FAMILY_PARSERS.values())):
        try:
            ToolParserManager.get_tool_parser(name)(tokenizer)
        except Exception:
            refused.add(name)
    assert refused == set(PARSER_TOKENS) & set(FAMILY_PARSERS.values())
    assert pick_tool_parser(demo_dir / "base", {"model_type": "llama"})[0] is None
