"""Where each setting's value came from, read the way operators write them, and told back in
one line when it is wrong.

The config file (TOML or YAML) is read with the line of each key, so an error names
``gateway.toml:7``; a list setting takes a plain value, a comma-separated list or a JSON list
from the environment and the file alike; a pydantic error becomes one line that names the
flag, the ``LORAGATE_*`` variable or the file line it came from, and an unknown name gets the
nearest valid one.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "LORAGATE_"
CONFIG_ENV = "LORAGATE_CONFIG"  # the config file when --config is not given

# Engine command lines are shell words; the other lists are comma-separated (a JSON list keeps
# a value that holds a comma whole).
SHELL_WORD_LISTS = ("engine_args", "engine_command")
# NAME=SOURCE entries split only at a comma followed by the next NAME=, so a source URL with a
# comma in its query stays whole (unless what follows that comma looks like NAME=).
_NEXT_LORA = re.compile(r",\s*(?=[A-Za-z0-9][A-Za-z0-9._-]*=)")
_TOML_KEY = re.compile(r"""^\s*(["']?)([A-Za-z0-9_-]+)\1\s*=""")
_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


class SettingsError(ValueError):
    """Settings that cannot be used: one line per problem, each naming where it came from."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def list_value(name: str, value: Any) -> Any:
    """A list setting given as one string: a JSON list, shell words (the engine's command
    lines), NAME=SOURCE entries, or comma-separated values. Lists pass as they are."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON list ({exc.msg} at column {exc.colno})") from None
    if name in SHELL_WORD_LISTS:
        return shlex.split(text)
    parts = _NEXT_LORA.split(text) if name == "lora" else text.split(",")
    items = [part.strip() for part in parts if part.strip()]
    if not items and name == "api_key":
        return [text]  # an empty key is refused (auth.check_key_settings), not dropped
    return items


@dataclass
class ConfigFile:
    """A config file's settings (keys with '_' for '-') and the line each key is on."""

    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    spelled: dict[str, str] = field(default_factory=dict)  # key as written in the file

    def where(self, key: str) -> str:
        line = self.lines.get(key)
        return f"{self.path}:{line}" if line else str(self.path)


def read_config_file(path: Path) -> ConfigFile:
    """Read a TOML or YAML config file; keys use the flag names with '-' or '_'."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(
            [f"{path}: cannot read the config file: {exc.strerror or exc}"]
        ) from None
    except UnicodeDecodeError:
        raise SettingsError([f"{path}: the config file is not UTF-8 text"]) from None
    toml = path.suffix.lower() == ".toml"
    data, lines = _parse_toml(path, text) if toml else _parse_yaml(path, text)
    if not isinstance(data, dict):
        raise SettingsError(
            [f"{path}: the config file must hold a table of settings, not a {type(data).__name__}"]
        )
    config = ConfigFile(path)
    for key, value in data.items():
        name = str(key).replace("-", "_")
        config.values[name] = value
        config.spelled[name] = str(key)
        if str(key) in lines:
            config.lines[name] = lines[str(key)]
    return config


def _parse_toml(path: Path, text: str) -> tuple[Any, dict[str, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        at = _TOML_AT.search(message)
        if at is None:
            raise SettingsError([f"{path}: {message}"]) from None
        line, column = at.groups()
        raise SettingsError([f"{path}:{line}: {message[: at.start()]} (column {column})"]) from None
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("["):
            break  # a [table]: its keys are not top-level settings
        match = _TOML_KEY.match(line)
        if match:
            lines.setdefault(match.group(2), number)
    return data, lines


def _parse_yaml(path: Path, text: str) -> tuple[Any, dict[str, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise SettingsError(
            [f"{where}: {exc.problem or exc.context or 'not valid YAML'}"]
        ) from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {exc}"]) from None
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            lines.setdefault(str(key_node.value), key_node.start_mark.line + 1)
    return ({} if data is None else data), lines


def nearest(name: str, names: Iterable[str]) -> str | None:
    """The valid name closest to a misspelt one, if any is close."""
    matches = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_keys(config: ConfigFile, fields: Iterable[str]) -> list[str]:
    """One line per config key that names no setting, with the nearest valid one."""
    known = list(fields)
    problems = []
    for name in config.values:
        if name in known:
            continue
        spelled = config.spelled[name]
        line = f"{config.where(name)}: unknown key '{spelled}'"
        match = nearest(name, known)
        if match:
            suggestion = match.replace("_", "-") if "-" in spelled else match
            line += f"; did you mean '{suggestion}'?"
        problems.append(line)
    return problems


def unknown_environment(fields: Iterable[str], others: Iterable[str]) -> list[str]:
    """Warnings for ``LORAGATE_*`` variables that name no setting but nearly do (a typo such
    as ``LORAGATE_MAX_LORA``); variables read elsewhere (``others``) are left alone."""
    known = [name.upper() for name in fields]
    warnings = []
    for variable in sorted(os.environ):
        name = variable.upper().removeprefix(ENV_PREFIX)
        if not variable.upper().startswith(ENV_PREFIX) or name in known or variable in others:
            continue
        match = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if match:
            warnings.append(
                f"{variable} is not a setting and is ignored; did you mean {ENV_PREFIX}{match[0]}?"
            )
    return warnings


def environment_name(field_name: str) -> str | None:
    """The ``LORAGATE_*`` variable set for a field, as spelled in the environment."""
    wanted = ENV_PREFIX + field_name.upper()
    return next((name for name in os.environ if name.upper() == wanted), None)


def describe(error: dict[str, Any], where: Callable[[str], str]) -> str:
    """One pydantic error as one line: where the value came from, what is wrong with it."""
    location = error.get("loc") or ()
    name = str(location[0]) if location else ""
    kind = error.get("type", "")
    value = error.get("input")
    context = error.get("ctx") or {}
    message = str(error.get("msg", "invalid"))
    if kind == "extra_forbidden":
        return f"unknown setting '{name}'"
    if kind.startswith("value_error") or kind == "assertion_error":
        text = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        return f"{where(name)}: {text}" if name else text
    words = {
        "int_parsing": "not an integer",
        "int_from_float": "not a whole number",
        "float_parsing": "not a number",
        "bool_parsing": "not true or false",
        "literal_error": f"must be {context.get('expected')}",
        "greater_than_equal": f"must be at least {context.get('ge')}",
        "greater_than": f"must be more than {context.get('gt')}",
        "less_than_equal": f"must be at most {context.get('le')}",
        "list_type": "must be a list (a value, comma-separated values or a JSON list)",
    }
    text = words.get(kind, message[:1].lower() + message[1:])
    return f"{where(name)}: {text}: {value!r}" if name else f"{text}: {value!r}"
