"""Tool calling with one flag: which ``--tool-call-parser`` the engine gets, checked and picked.

vLLM answers ``tool_choice: "auto"`` only when started with ``--enable-auto-tool-choice
--tool-call-parser NAME``, NAME matching how the model writes its calls. vLLM 0.32 wants them for a named or
``"required"`` ``tool_choice`` too (400 "tool_choice=function ... requires --tool-call-parser
to be set"), although it answers those through structured outputs whatever the model and
whatever the parser. So ``gateway serve`` always passes both: ``--tool-call-parser NAME`` when
given; else the parser of the model's family when its format is known and the chat template
renders ``tools`` (without that the model never saw the tools); else ``pythonic``
(``FALLBACK_PARSER``), so that named tool calls work on any model, and ``auto`` on a model (or
adapter) that writes calls as ``[get_weather(city="Paris")]``. Why pythonic: it needs no
special tokens and has no xgrammar structural tag, so a named or required ``tool_choice`` is
constrained by the tool's own JSON schema, as ``response_format`` would be. Measured on the
tiny demo: with ``hermes`` (whose structural tag wraps calls in ``<tool_call>`` tags the model
has never seen) a named call came back with the arguments ``false``; with ``pythonic``, valid
arguments.
``--tool-call-parser none`` passes neither (tool calls then fail at the engine).

The names are read from the engine's installed vLLM (the ``_TOOL_PARSERS_TO_REGISTER`` table
in ``vllm/tool_parsers/__init__.py``, parsed, not imported: importing vLLM would import torch
into the gateway); ``VLLM_032_TOOL_PARSERS`` is the checked fallback when that file cannot be
read, and a unit test compares it with the installed vLLM. A parser registered by a plugin
file (vLLM's ``--tool-parser-plugin FILE`` after ``--``) is accepted by name: the names its
``@ToolParserManager.register_module`` decorators write are read from the file.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import subprocess
import sys
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from loragate.engine_flags import engine_arg_value

log = logging.getLogger("loragate.supervisor")

# vLLM 0.32's registry (``ToolParserManager.list_registered()`` without plugins).
VLLM_032_TOOL_PARSERS = frozenset(
    [
        "apertus",
        "cohere_command3",
        "cohere_command4",
        "deepseek_v3",
        "deepseek_v31",
        "deepseek_v32",
        "deepseek_v4",
        "deepseek_v41",
        "dots",
        "ernie45",
        "functiongemma",
        "gemma4",
        "gigachat3",
        "glm45",
        "glm47",
        "granite",
        "granite-20b-fc",
        "granite4",
        "hermes",
        "hf",
        "hunyuan_a13b",
        "hy_v3",
        "hy_v4",
        "inkling",
        "internlm",
        "jamba",
        "k2_horizon",
        "kimi_k2",
        "kimi_k3",
        "lfm2",
        "ling3",
        "llama3_json",
        "llama4_json",
        "llama4_pythonic",
        "longcat",
        "mimo",
        "minicpm5",
        "minimax_m2",
        "minimax_m3",
        "mistral",
        "muse_glimmer",
        "olmo3",
        "openai",
        "phi4_mini_json",
        "plamo3",
        "poolside_v1",
        "pythonic",
        "qwen3_coder",
        "qwen3_json",
        "qwen3_xml",
        "seed_oss",
        "step3",
        "step3p5",
        "xlam",
    ]
)

FALLBACK_PARSER = "pythonic"

# config.json ``model_type`` -> the parser for the way that family writes tool calls.
FAMILY_PARSERS = {
    "llama": "llama3_json",  # Llama 3.1+ (templates with tools); older Llamas have none
    "llama4": "llama4_pythonic",
    "mistral": "mistral",
    "mistral3": "mistral",
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "smollm3": "hermes",
    "granite": "granite",
    "granitemoe": "granite",
    "internlm2": "internlm",
    "jamba": "jamba",
    "phi3": "phi4_mini_json",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "openai",
    "kimi_k2": "kimi_k2",
    "glm4_moe": "glm45",
    "ernie4_5": "ernie45",
    "ernie4_5_moe": "ernie45",
    "olmo3": "olmo3",
    "seed_oss": "seed_oss",
    "lfm2": "lfm2",
    "minimax_m2": "minimax_m2",
}

# Tokens a parser looks up in the tokenizer when the engine starts (vLLM 0.32 builds each
# parser once against the tokenizer and refuses to start, "--tool-call-parser NAME cannot be
# used with the tokenizer", when one is missing): a family's parser is picked only when the
# model's tokenizer has them. A model of the Llama family with a tools template of its own
# and no ``<|python_tag|>`` gets ``pythonic`` instead of ``llama3_json``.
PARSER_TOKENS = {
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "jamba": ("<tool_calls>", "</tool_calls>"),
    "deepseek_v3": (
        "<\uff5ctool\u2581calls\u2581begin\uff5c>",
        "<\uff5ctool\u2581calls\u2581end\uff5c>",
    ),
    "lfm2": ("<|tool_call_start|>", "<|tool_call_end|>"),
}

_PROBE = "import importlib.util as u; s = u.find_spec('vllm'); print(s.submodule_search_locations[0] if s else '')"


class ToolParserError(ValueError):
    pass


def installed_tool_parsers(python: str = sys.executable) -> frozenset[str]:
    """The parser names the engine's vLLM registers (the checked list when unreadable)."""
    names = _registered_names(python)
    return names if names else VLLM_032_TOOL_PARSERS


@lru_cache(maxsize=4)
def _registered_names(python: str) -> frozenset[str] | None:
    try:
        package = _vllm_dir(python)
        if package is None:
            return None
        tree = ast.parse((package / "tool_parsers" / "__init__.py").read_text())
    except (OSError, SyntaxError, subprocess.SubprocessError) as exc:
        log.debug("tool parsers: could not read vLLM's registry: %s", exc)
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER" for t in node.targets
        ):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return None
            return frozenset(str(name) for name in table)
    return None


def _vllm_dir(python: str) -> Path | None:
    if python == sys.executable:
        spec = importlib.util.find_spec("vllm")  # finds the package without importing it
        locations = spec.submodule_search_locations if spec is not None else None
        return Path(next(iter(locations))) if locations else None
    found = subprocess.run(
        [python, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    ).stdout.strip()
    return Path(found) if found else None


def plugin_parser_names(plugin: Path) -> frozenset[str] | None:
    """The parser names a ``--tool-parser-plugin`` file registers with
    ``@ToolParserManager.register_module(...)`` (a name, a list of names, or none: the
    class's name), read without running it; None when a name is not written literally.
    ``ToolParserError`` when the file cannot be read or parsed (the engine would not start)."""
    try:
        tree = ast.parse(plugin.read_text(encoding="utf-8"), filename=str(plugin))
    except (OSError, UnicodeDecodeError, SyntaxError) as exc:
        raise ToolParserError(f"--tool-parser-plugin {plugin}: cannot be read: {exc}") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            func = call.func if call is not None else decorator
            if not (isinstance(func, ast.Attribute) and func.attr == "register_module"):
                continue
            given = call.args[0] if call is not None and call.args else None
            if call is not None:
                given = next((k.value for k in call.keywords if k.arg == "name"), given)
            if given is None or (isinstance(given, ast.Constant) and given.value is None):
                names.add(node.name)
                continue
            try:
                value = ast.literal_eval(given)
            except ValueError:
                return None  # a name computed at import time: only the engine can tell
            names.update([value] if isinstance(value, str) else map(str, value))
    return frozenset(names)


def check_tool_parser(
    name: str, python: str = sys.executable, engine_args: Iterable[str] = ()
) -> str:
    """``name`` when the engine's vLLM knows it, or a ``--tool-parser-plugin`` among the
    engine arguments registers it; else a ``ToolParserError`` listing the names."""
    known = set(installed_tool_parsers(python))
    plugin = engine_arg_value(list(engine_args), "--tool-parser-plugin")
    if plugin:
        registered = plugin_parser_names(Path(plugin).expanduser())
        if registered is None:
            log.info("tool calling: %s registers names loragate cannot read; trusting it", plugin)
            return name
        known |= registered
    if name not in known:
        raise ToolParserError(
            f"--tool-call-parser {name!r} is not one vLLM knows; choose one of: "
            + ", ".join(sorted(known))
        )
    return name


def template_takes_tools(model_dir: Path) -> bool:
    """Whether the model's chat template renders the ``tools`` a request carries."""
    texts: list[str] = []
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        texts.append(jinja.read_text(errors="replace"))
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            template: Any = json.loads(config.read_text()).get("chat_template")
        except (ValueError, OSError):
            template = None
        if isinstance(template, str):
            texts.append(template)
        elif isinstance(template, list):  # named templates: [{"name", "template"}]
            texts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return any("tools" in text for text in texts)


def pick_tool_parser(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """(parser, why) for a model: its family's parser when its template renders tools."""
    family = str(config.get("model_type", ""))
    parser = FAMILY_PARSERS.get(family)
    if parser is None:
        return None, f"no known tool-call format for model type {family!r}"
    if not template_takes_tools(model_dir):
        return None, "the model's chat template does not render tools"
    vocabulary = tokenizer_vocabulary(model_dir)
    missing = [
        t for t in PARSER_TOKENS.get(parser, ()) if vocabulary is not None and t not in vocabulary
    ]
    if missing:
        return None, (
            f"the tokenizer lacks {', '.join(missing)}, which vLLM's {parser!r} parser (model "
            f"type {family!r}) needs"
        )
    return parser, f"model type {family!r} with a chat template that renders tools"


def tokenizer_vocabulary(model_dir: Path) -> set[str] | None:
    """Every token of the model's ``tokenizer.json`` (vocabulary and added tokens); None when
    there is none to read (a sentencepiece-only model: nothing is checked then)."""
    try:
        data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    tokens: set[str] = set()
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        tokens.update(vocab)
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        tokens.update(str(item[0]) for item in vocab if isinstance(item, list) and item)
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and "content" in added:
            tokens.add(str(added["content"]))
    return tokens


def tool_call_parser(
    setting: str | None,
    model_dir: Path,
    config: dict[str, Any],
    engine_args: list[str],
    python: str,
) -> str | None:
    """The parser the engine starts with (logged; it comes with ``--enable-auto-tool-choice``);
    None when engine arguments already name one (the CLI refuses them after ``--``; a config
    file or ``create_server`` may not) or with ``--tool-call-parser none``."""
    parser: str | None
    if any(arg.startswith("--tool-call-parser") for arg in engine_args):
        log.info("tool calling: as the engine arguments after -- say")
        return None
    if setting == "none":
        log.info("tool calling: off (--tool-call-parser none)")
        return None
    if setting is not None:
        parser, why = check_tool_parser(setting, python, engine_args), "--tool-call-parser"
    else:
        parser, why = pick_tool_parser(model_dir, config)
        if parser is not None and parser not in installed_tool_parsers(python):
            parser, why = None, f"this vLLM has no {parser!r} parser"
        if parser is None:
            parser, why = FALLBACK_PARSER, f"the fallback: {why}; --tool-call-parser NAME to choose"
    log.info("tool calling: vLLM's %r tool-call parser (%s)", parser, why)
    return parser
