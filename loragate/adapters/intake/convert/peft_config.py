"""The ``adapter_config.json`` written next to converted weights: rebuilt from the tensors'
names and shapes, with the source config's fields where they still hold."""

from __future__ import annotations

import math
from typing import Any

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.mlx import mlx_config_fields
from loragate.adapters.intake.peft_layout import CONFIG_FILENAME, split_lora_key

# Config fields carried over from a PEFT config as they are; everything else is rebuilt.
KEPT_FIELDS = (
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "modules_to_save",
    "bias",
    "lora_dropout",
    "task_type",
)


def build_peft_config(
    src_config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    fmt: str,
    base_model: str | None,
) -> dict[str, Any]:
    """A complete ``adapter_config.json`` for tensors of ``shapes`` converted from ``fmt``."""
    peft_type = str(src_config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise ConversionError(
            f"the adapter is a {peft_type} adapter; only LoRA adapters can be served"
        )
    modules: set[str] = set()
    ranks: dict[str, int] = {}
    for name, shape in shapes.items():
        split = split_lora_key(name)
        if split is None:
            raise ConversionError(
                f"tensor {name!r} is not a LoRA weight; the adapter cannot be served as a LoRA"
            )
        module, part = split
        modules.add(module.rsplit(".", 1)[-1])
        if part in ("A", "embedding_A"):
            ranks[module] = int(shape[0])
    if not ranks:
        raise ConversionError("the adapter holds no lora_A weights")
    config: dict[str, Any] = {k: src_config[k] for k in KEPT_FIELDS if k in src_config}
    if fmt == "mlx":
        config.update(mlx_config_fields(src_config, ranks))
    r = _rank(src_config if fmt != "mlx" else {"r": config["r"]}, ranks)
    alpha = config.get("lora_alpha", src_config.get("lora_alpha"))
    if alpha is None:
        if fmt == "tinker":
            raise ConversionError(
                f"the Tinker {CONFIG_FILENAME} has no lora_alpha; add the value the run was "
                "trained with (Tinker's LoRA rank defaults to 32) and convert again"
            )
        alpha = 8  # PEFT's LoraConfig default: what PEFT itself would load
    config.update(
        {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": alpha,
            "target_modules": sorted(modules),
            "bias": config.get("bias") or "none",
            "task_type": config.get("task_type") or "CAUSAL_LM",
            "modules_to_save": config.get("modules_to_save") or None,
            "base_model_name_or_path": base_model
            or src_config.get("base_model_name_or_path")
            or "",
            "inference_mode": True,
        }
    )
    config.setdefault("use_dora", False)
    config.setdefault("use_rslora", False)
    return config


def _rank(src_config: dict[str, Any], ranks: dict[str, int]) -> int:
    found = sorted(set(ranks.values()))
    declared = src_config.get("r")
    if declared is not None and not _whole_number(declared):
        raise ConversionError(
            f"{CONFIG_FILENAME} r must be a positive whole number, got {declared!r}"
        )
    if src_config.get("rank_pattern"):
        return int(declared) if declared else found[-1]
    if len(found) > 1:
        raise ConversionError(
            f"the adapter's modules have different ranks ({', '.join(map(str, found))}) but its "
            "config has no rank_pattern saying which is which; re-export it with PEFT"
        )
    if declared is not None and int(declared) != found[0]:
        raise ConversionError(
            f"{CONFIG_FILENAME} says r={declared} but the weights have rank {found[0]}; the "
            "config does not belong to these weights"
        )
    return found[0]


def _whole_number(value: Any) -> bool:
    """A rank as a config may give it: 8 or 8.0, never NaN, Infinity, 0 or true."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and float(value).is_integer()
        and value >= 1
    )
