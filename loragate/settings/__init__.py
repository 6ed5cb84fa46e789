"""One settings model for the CLI, the config file, ``LORAGATE_*`` env vars and ``create_server()``.

Precedence, highest first: explicit values (CLI flags, ``create_server`` keywords), environment
variables, the config file (TOML or YAML; ``--config`` or ``LORAGATE_CONFIG``), defaults.
``VLLM_API_KEY`` is the inference key when no other key setting is given, as in vLLM. A wrong
value fails in one line naming its source (``sources``).

Each setting is declared once, in the field group of its concern (``serving``, ``catalog``, ``engine``,
``access``, ``supervision``, ``request_limits``, ``adapter_store``, ``observability``);
``Settings`` assembles them and holds what spans groups: the one-string-or-many lists, the
checks between settings, and where values come from.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any

from pydantic import PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from loragate.engine_flags import parallel_layout
from loragate.settings.access import AccessFields
from loragate.settings.adapter_store import AdapterStoreFields
from loragate.settings.catalog import CatalogFields
from loragate.settings.engine import EngineFields
from loragate.settings.observability import ObservabilityFields
from loragate.settings.request_limits import RequestLimitFields
from loragate.settings.serving import ServingFields
from loragate.settings.sources import (
    CONFIG_ENV,
    ConfigFile,
    SettingsError,
    describe,
    environment_name,
    list_value,
    nearest,
    read_config_file,
    unknown_environment,
    unknown_keys,
)
from loragate.settings.supervision import SupervisionFields

__all__ = ["Settings", "SettingsError", "load_settings", "settings_warnings"]
VLLM_KEY_ENV = "VLLM_API_KEY"
# LORAGATE_* variables read outside Settings: not typos of a setting.
OTHER_VARIABLES = ("LORAGATE_URL", CONFIG_ENV)

_file_values: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "loragate_file_values", default=None
)


class Settings(
    # pydantic orders inherited fields from the last base to the first, so the groups are
    # listed bottom-up: the fields (and `gateway serve --help`) read serving first, logs last.
    ObservabilityFields,
    AdapterStoreFields,
    RequestLimitFields,
    SupervisionFields,
    AccessFields,
    EngineFields,
    CatalogFields,
    ServingFields,
    BaseSettings,
):
    # enable_decoding off: a list variable is not JSON-only; ``list_value`` reads it.
    model_config = SettingsConfigDict(env_prefix="LORAGATE_", extra="forbid", enable_decoding=False)
    # Whether the inference key is vLLM's VLLM_API_KEY (auth logs it when the gateway starts).
    _key_from_vllm_env: bool = PrivateAttr(default=False)

    @field_validator(
        "lora",
        "api_key",
        "cors_origins",
        "allowed_hosts",
        "allowed_source_networks",
        "engine_args",
        "engine_command",
        mode="before",
    )
    @classmethod
    def _list_from_one_string(cls, value: Any, info: Any) -> Any:
        return list_value(info.field_name, value)

    @model_validator(mode="after")
    def _vllm_api_key_when_no_key_is_set(self) -> Settings:
        vllm_key = os.environ.get(VLLM_KEY_ENV, "").strip()
        if vllm_key and not self.api_key and self.api_key_file is None:
            self.api_key = [vllm_key]
            self._key_from_vllm_env = True
        return self

    @property
    def key_from_vllm_env(self) -> bool:
        return self._key_from_vllm_env

    @model_validator(mode="after")
    def _one_owner_of_the_adapters(self) -> Settings:
        if self.adapters_manifest and self.lora:
            raise ValueError(
                "adapters_manifest and lora both name adapters: with a manifest, list every "
                "adapter in it (lora: " + ", ".join(self.lora) + ")"
            )
        if self.adapters_manifest and self.upstream_url:
            raise ValueError(
                "adapters_manifest needs the engine loragate runs; with upstream_url the "
                "adapters are the upstream server's"
            )
        return self

    @model_validator(mode="after")
    def _a_catalog_or_one_model(self) -> Settings:
        if not self.models:
            return self
        single = [
            name for name in ("model", "upstream_url", "run_id") if getattr(self, name) is not None
        ] + (["lora"] if self.lora else [])
        if single:
            raise ValueError(
                "models (a catalog) and " + ", ".join(single) + " both say what to serve: give "
                "each base model its entry under models (with its own lora), or drop models"
            )
        with_lora = [model_id for model_id, entry in self.models.items() if entry.lora]
        if self.adapters_manifest and with_lora:
            raise ValueError(
                "adapters_manifest and the lora of models " + ", ".join(with_lora) + " both name "
                'adapters: with a manifest, list every model\'s in it ({"models": {"ID": '
                '{"adapters": ...}}})'
            )
        return self

    @model_validator(mode="after")
    def _parallelism_given_once(self) -> Settings:
        parallel_layout(self.engine_args, self.parallel_options())  # ValueError on a conflict
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        file_source = InitSettingsSource(settings_cls, init_kwargs=_file_values.get() or {})
        return (init_settings, env_settings, file_source)


def load_settings(
    config_file: Path | None = None, *, from_flags: bool = False, **explicit: Any
) -> Settings:
    """Settings from explicit values, then env, then the config file, then defaults.

    The config file is ``config_file``, else the file ``LORAGATE_CONFIG`` names. Every problem
    raises ``SettingsError``, one line each naming its source: the flag (``from_flags``: the
    values are `gateway serve`'s options) or keyword, the variable, or the file's line.
    """
    values = {key: value for key, value in explicit.items() if value is not None}
    if config_file is None and os.environ.get(CONFIG_ENV):
        config_file = Path(os.environ[CONFIG_ENV])
    if problems := _unknown_names(values):
        raise SettingsError(problems)
    config = read_config_file(config_file) if config_file else None
    if config is not None and (problems := unknown_keys(config, Settings.model_fields)):
        raise SettingsError(problems)
    token = _file_values.set(config.values if config else {})
    try:
        return Settings(**values)
    except ValidationError as exc:
        where = _source_names(values, config, from_flags)
        raise SettingsError([describe(dict(error), where) for error in exc.errors()]) from None
    finally:
        _file_values.reset(token)


def _unknown_names(values: dict[str, Any]) -> list[str]:
    """One line per explicit value (a ``create_server`` keyword) that names no setting."""
    problems = []
    for name in values:
        if name not in Settings.model_fields:
            match = nearest(name, Settings.model_fields)
            problems.append(
                f"unknown setting '{name}'" + (f"; did you mean '{match}'?" if match else "")
            )
    return problems


def settings_warnings() -> list[str]:
    """Warnings about the environment: ``LORAGATE_*`` variables that nearly name a setting."""
    return unknown_environment(Settings.model_fields, OTHER_VARIABLES)


def _source_names(values: dict[str, Any], config: ConfigFile | None, from_flags: bool) -> Any:
    """Where a field's value came from, the way its owner wrote it."""

    def where(name: str) -> str:
        if name in values:
            return _flag(name) if from_flags else name
        variable = environment_name(name)
        if variable is not None:
            return variable
        if config is not None and name in config.values:
            return config.where(name)
        return name

    return where


def _flag(name: str) -> str:
    if name == "engine_args":
        return "the engine arguments after --"
    extra = Settings.model_fields[name].json_schema_extra
    flags = extra.get("cli") if isinstance(extra, dict) else None
    if isinstance(flags, list) and flags:
        return str(flags[0]).split("/")[0]
    return "--" + name.replace("_", "-")


def config_schema() -> dict[str, Any]:
    """The config file's JSON schema (for editors and CI), generated from ``Settings``.

    Keys are accepted as snake_case or kebab-case (both listed), a list setting as a list or
    one string (a value, comma-separated values or shell words), and nothing else.
    """
    schema = Settings.model_json_schema()
    properties: dict[str, Any] = {}
    for name, prop in schema["properties"].items():
        prop = {key: value for key, value in prop.items() if not key.startswith("cli")}
        prop.pop("title", None)
        if name == "engine_python":
            prop.pop("default", None)  # this machine's interpreter, not a default to publish
        properties[name] = _list_or_one_string(prop)
        if "_" in name:
            properties[name.replace("_", "-")] = {"$ref": f"#/properties/{name}"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "loragate gateway serve config file (TOML or YAML)",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def _list_or_one_string(prop: dict[str, Any]) -> dict[str, Any]:
    """A list setting's schema, widened to the one string ``list_value`` also reads."""
    if prop.get("type") == "array":
        array = {key: prop.pop(key) for key in ("type", "items") if key in prop}
        return {**prop, "anyOf": [array, {"type": "string"}]}
    if any(option.get("type") == "array" for option in prop.get("anyOf", [])):
        return {**prop, "anyOf": [*prop["anyOf"], {"type": "string"}]}
    return prop
