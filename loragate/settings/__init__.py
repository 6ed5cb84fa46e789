"""One settings model for the CLI, the config file, ``LORAGATE_*`` env vars and ``create_server()``.

Precedence, highest first: explicit values (CLI flags, ``create_server`` keywords), environment
variables, the config file (TOML or YAML), defaults.

Each setting is declared once, in the field group of its concern (``serving``, ``engine``,
``access``, ``supervision``, ``request_limits``, ``adapter_store``, ``observability``);
``Settings`` assembles them and holds what spans groups: the one-string-or-many lists, the
checks between settings, and where values come from.
"""

from __future__ import annotations

import contextvars
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from loragate.engine_flags import parallel_layout
from loragate.settings.access import AccessFields
from loragate.settings.adapter_store import AdapterStoreFields
from loragate.settings.engine import EngineFields
from loragate.settings.observability import ObservabilityFields
from loragate.settings.request_limits import RequestLimitFields
from loragate.settings.serving import ServingFields
from loragate.settings.supervision import SupervisionFields

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
    ServingFields,
    BaseSettings,
):
    model_config = SettingsConfigDict(env_prefix="LORAGATE_", extra="forbid")

    @field_validator("lora", "api_key", "cors_origins", "engine_args", mode="before")
    @classmethod
    def _accept_single_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

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


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML or YAML config file; keys use the flag names with '-' or '_'."""
    text = path.read_text()
    data: Any
    data = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must hold a table of settings")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def load_settings(config_file: Path | None = None, **explicit: Any) -> Settings:
    """Settings from explicit values, then env, then the config file, then defaults."""
    values = {key: value for key, value in explicit.items() if value is not None}
    token = _file_values.set(read_config_file(config_file) if config_file else {})
    try:
        return Settings(**values)
    finally:
        _file_values.reset(token)
