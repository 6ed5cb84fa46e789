"""`gateway serve`'s options, built from the ``Settings`` fields marked ``serve_option``.

Each setting is declared once, in its ``loragate.settings`` field group: its type, default,
constraints and description there become the option's type, help and ``(default: ...)`` here.
Every option defaults to None, meaning "not given", so the environment and the config file
still apply.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic.fields import FieldInfo

from loragate.settings import Settings

MIB = 1024 * 1024


def serve_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per serve option, annotated for typer, in the fields' order."""
    parameters = []
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra
        if not isinstance(extra, dict) or "cli" not in extra:
            continue
        flags = [str(flag) for flag in typing.cast(list[str], extra["cli"])]
        option_type, choices = _option_type(name, field.annotation)
        option = typer.Option(
            *(flags or [f"--{name.replace('_', '-')}"]),
            help=_help(field),
            envvar=typing.cast(str | None, extra.get("cli_envvar")),
            case_sensitive=not choices,
        )
        annotation = Annotated[option_type | None, option]  # type: ignore[valid-type]
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
            )
        )
    return parameters


def given_values(options: dict[str, Any]) -> dict[str, Any]:
    """The options as ``load_settings`` takes them: None (and an empty list) for not given."""
    values = {}
    for name, value in options.items():
        if isinstance(value, enum.Enum):
            value = value.value
        values[name] = value if value != [] else None
    return values


def _option_type(name: str, annotation: Any) -> tuple[Any, bool]:
    """The type typer parses (a Literal becomes an enum of its values); whether it is one."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is Literal:
        values = [str(value) for value in typing.get_args(annotation)]
        return enum.Enum(f"{name}_choice", {v: v for v in values}, type=str), True
    if typing.get_origin(annotation) is list:
        return list[str], False
    if annotation in (str, int, float, bool, Path):
        return annotation, False
    raise TypeError(f"Settings.{name}: no command-line type for {annotation!r}")


def _help(field: FieldInfo) -> str:
    from rich.markup import escape  # typer renders help as rich markup: "[@REV]" would vanish

    text = escape(field.description or "")
    default = field.default
    if field.default_factory is not None or default is None or default is False:
        return text
    if default is True:
        shown = "on"
    elif isinstance(default, int) and default >= MIB and default % MIB == 0:
        shown = f"{default // MIB} MiB"
    else:
        shown = str(default)
    return f"{text} (default: {shown})"  # not [..]: rich would read that as markup
