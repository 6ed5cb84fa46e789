"""A catalog of base models behind one gateway: each its own engine and adapters, booted on
demand, at most ``max_loaded_models`` resident and within ``memory_budget``.

Declared in the config file (``models:``); the simple case, one model, stays ``--model``.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator

from loragate.engine_flags import check_engine_args

# A catalog id is what clients send as ``model``: the adapters' name rule (no '@' or '/').
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CatalogModel(BaseModel):
    """One base model of the catalog (``models.ID``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The base model: a directory, a Hugging Face id or a GGUF file.")
    lora: list[str] = Field(
        default_factory=list, description="NAME=SOURCE adapters of this base, served from boot on."
    )
    adapter_dir: Path | None = Field(
        default=None,
        description=(
            "A directory whose sub-folders are adapters of this base: an unregistered name that "
            "names one is loaded on its first request."
        ),
    )
    resolvers: list[str] = Field(
        default_factory=list,
        description=(
            "Where else an unregistered adapter name is looked for, in order, after adapter_dir: "
            "an hf://ORG/ prefix (the name is a repo of ORG) or an http(s) URL template with "
            "{name} (e.g. https://host/adapters/{name}.tar.gz). Nothing else is fetched."
        ),
    )
    ttl: float | None = Field(
        default=None, gt=0, description="Seconds idle after which the engine is unloaded."
    )
    keep: bool = Field(default=False, description="Never evicted to make room for another model.")
    preload: bool = Field(default=False, description="Booted when the gateway starts.")
    sleep: bool = Field(
        default=False,
        description=(
            "GPU builds: unload by vLLM's sleep mode (level 1: weights to host memory, KV cache "
            "dropped) instead of stopping the engine, so loading it again is a wake of seconds, "
            "not a boot. vLLM's CPU build has no sleep mode: there it is ignored, with a warning."
        ),
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Engine flags for this model, after the gateway's own."
    )
    devices: list[int] | None = Field(
        default=None,
        description=(
            "The GPUs this model's engine runs on, by their number in `gateway plan`'s list "
            "(nvidia-smi's order, within CUDA_VISIBLE_DEVICES), one per GPU its parallel "
            "layout uses. Default: the plan places it on the GPUs with room, beside the models "
            "that fit there."
        ),
    )

    @field_validator("lora", "engine_args", "resolvers", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("engine_args")
    @classmethod
    def _engine_args_leave_loragates_flags(cls, value: list[str]) -> list[str]:
        # --model, --port, --enable-lora, ...: what the catalog sets for each model's engine.
        check_engine_args(value, where="a model's engine_args")
        return value

    @field_validator("devices")
    @classmethod
    def _devices_are_distinct_gpus(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or min(value) < 0 or len(set(value)) != len(value)):
            raise ValueError("devices: give distinct GPU numbers from 0, e.g. [0] or [0, 1]")
        return value

    @field_validator("resolvers")
    @classmethod
    def _resolvers_are_places(cls, value: list[str]) -> list[str]:
        for place in value:
            hub = place.startswith("hf://") and place.endswith("/") and place.count("/") == 3
            url = place.startswith(("http://", "https://")) and "{name}" in place
            if not (hub or url):
                raise ValueError(
                    f"resolver {place!r}: give an hf://ORG/ prefix or an http(s) URL template "
                    "with {name}"
                )
        return value


class CatalogFields(BaseModel):
    models: dict[str, CatalogModel] = Field(
        default_factory=dict,
        description=(
            "Several base models behind one gateway (the config file, or --model repeated): ID: "
            "{model, lora, adapter_dir, resolvers, ttl, keep, preload, sleep, engine_args, "
            "devices}. Each gets its own engine, booted on its first request, and its own "
            "adapters; clients name the ID or an adapter (docs/catalog.md)."
        ),
    )
    max_loaded_models: int | None = Field(
        default=None,
        ge=1,
        description="With models: at most this many engines resident at once (default: no cap).",
    )
    memory_budget: ByteSize | None = Field(
        default=None,
        description=(
            "With models: the memory the resident engines may take together (e.g. 12GiB). "
            "Default: each GPU's free memory at start, counted per GPU and never summed across "
            "GPUs (docs/gpu.md), or the available RAM on the CPU build."
        ),
    )

    @field_validator("models")
    @classmethod
    def _ids_are_names(cls, value: dict[str, CatalogModel]) -> dict[str, CatalogModel]:
        bad = [model_id for model_id in value if not _ID.match(model_id)]
        if bad:
            raise ValueError(
                f"model ids must be letters, digits, '.', '_' or '-' (no '@' or '/'): {bad}"
            )
        return value
