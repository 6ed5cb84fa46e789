"""`gateway serve`'s options, built from the ``Settings`` fields marked ``serve_option``, and
the sections its help shows them in (``cli_help`` prints it).

Each setting is declared once, in its ``loragate.settings`` field group: its type, default,
constraints and description there become the option's type, metavar, help and
``(default: ...)`` here. Every option defaults to None, meaning "not given", so the
environment and the config file still apply.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from loragate.settings import Settings
from loragate.settings.access import AccessFields
from loragate.settings.adapter_store import AdapterStoreFields
from loragate.settings.engine import EngineFields
from loragate.settings.observability import ObservabilityFields
from loragate.settings.request_limits import RequestLimitFields
from loragate.settings.serving import ServingFields
from loragate.settings.supervision import SupervisionFields

KIB = 1024
MIB = 1024 * KIB

# The help's sections, in this order; an option's is its field group's unless PANEL_OF says.
GENERAL = "General"
PANELS = (
    GENERAL,
    "Model",
    "Adapters",
    "Network and keys",
    "Engine",
    "Supervision",
    "Limits",
    "Logging",
)
_GROUP_PANELS: dict[type[BaseModel], str] = {
    ServingFields: "Model",
    AdapterStoreFields: "Adapters",
    AccessFields: "Network and keys",
    EngineFields: "Engine",
    SupervisionFields: "Supervision",
    RequestLimitFields: "Limits",
    ObservabilityFields: "Logging",
}
PANEL_OF = {
    "lora": "Adapters",
    "adapters_manifest": "Adapters",
    "max_loras": "Adapters",
    "max_lora_rank": "Adapters",
    "max_cpu_loras": "Adapters",
    "host": "Network and keys",
    "port": "Network and keys",
    "cache_dir": "Model",
    "upstream_timeout": "Limits",
    "allowed_media_dir": "Limits",
}
# Metavars that say more than the type's word (TEXT, INT, NUMBER, PATH, SECONDS, BYTES, URL).
METAVAR_OF = {
    "model": "MODEL",
    "lora": "NAME=SOURCE",
    "api_key": "KEY",
    "admin_key": "KEY",
    "secret_key": "KEY",
    "cors_origins": "URL",
    "allowed_hosts": "HOST",
    "allowed_source_networks": "NETWORK",
    "adapter_source_roots": "DIR",
}


def serve_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per serve option, annotated for typer, in the fields' order."""
    parameters = []
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra
        if not isinstance(extra, dict) or "cli" not in extra:
            continue
        flags = [str(flag) for flag in typing.cast(list[str], extra["cli"])]
        option_type, choices = _option_type(name, field.annotation)
        if extra.get("cli_repeatable"):
            option_type = list[option_type]  # type: ignore[valid-type]
        option = typer.Option(
            *(flags or [f"--{name.replace('_', '-')}"]),
            help=_help(name, field),
            envvar=typing.cast(str | None, extra.get("cli_envvar")),
            show_envvar=False,  # the help shows it with LORAGATE_*, which the settings read
            case_sensitive=not choices,
            metavar=_metavar(name, option_type, choices),
            rich_help_panel=PANEL_OF.get(name) or _group_panel(name),
        )
        annotation = Annotated[option_type | None, option]  # type: ignore[valid-type]
        parameters.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
            )
        )
    return parameters


def given_values(options: dict[str, Any]) -> dict[str, Any]:
    """The options as ``load_settings`` takes them: None (and an empty list) for not given; a
    repeatable one-value option given once, its one value (given more, the list, which the
    field's validator reads)."""
    values = {}
    for name, value in options.items():
        if isinstance(value, enum.Enum):
            value = value.value
        if isinstance(value, list) and len(value) == 1 and _repeatable(name):
            (value,) = value
        values[name] = value if value != [] else None
    return values


def _repeatable(name: str) -> bool:
    field = Settings.model_fields.get(name)
    extra = field.json_schema_extra if field is not None else None
    return isinstance(extra, dict) and bool(extra.get("cli_repeatable"))


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


def _group_panel(name: str) -> str:
    group = next((g for g in _GROUP_PANELS if name in g.model_fields), None)
    return _GROUP_PANELS[group] if group is not None else "Other"


def _metavar(name: str, option_type: Any, choices: bool) -> str | None:
    """The option's value in words; None for a flag (it takes no value)."""
    if option_type is bool:
        return None
    if choices:
        return "{" + ",".join(member.value for member in option_type) + "}"
    if name in METAVAR_OF:
        return METAVAR_OF[name]
    if name.endswith("_bytes"):
        return "BYTES"
    if name.endswith(("_timeout", "_interval", "_deadline")):
        return "SECONDS"
    if name.endswith("_url"):
        return "URL"
    words = {Path: "PATH", int: "INT", float: "NUMBER"}
    return words.get(option_type, "TEXT")


def _help(name: str, field: FieldInfo) -> str:
    """The field's description, and its default when it has one worth saying."""
    text = field.description or ""
    if "default:" in text.lower():  # the description says it in words ("Default: no cap.")
        return text
    default = field.default
    if field.default_factory is not None:
        default = field.default_factory()  # type: ignore[call-arg]
    if default is None or default is False or default == []:
        return text
    if default is True:
        shown = "on"
    elif isinstance(default, Path):
        home = str(Path.home())
        shown = "~" + str(default)[len(home) :] if str(default).startswith(home) else str(default)
    elif name.endswith("_bytes") and isinstance(default, int) and default % KIB == 0:
        shown = f"{default // MIB} MiB" if default % MIB == 0 else f"{default // KIB} KiB"
    elif isinstance(default, float) and default.is_integer():
        shown = str(int(default))
    else:
        shown = str(default)
    return f"{text} (default: {shown})"


def setting_envvars(option: Any) -> list[str]:
    """The ``LORAGATE_*`` variable the settings read for a serve option (its help shows it
    beside the option's own)."""
    if option.name not in Settings.model_fields:
        return []
    return [f"{Settings.model_config.get('env_prefix', '')}{option.name.upper()}"]
