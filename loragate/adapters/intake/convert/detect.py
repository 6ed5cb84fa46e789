"""Which layout an adapter directory holds, and whether vLLM can load it as it is.

Cheap: reads JSON and safetensors headers only, never the tensors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.mlx import MLX_WEIGHTS
from loragate.adapters.intake.convert.peft_bin import BIN_WEIGHTS
from loragate.adapters.intake.convert.tinker import TINKER_MARKER, is_tinker_key
from loragate.adapters.intake.peft_layout import CONFIG_FILENAME, WEIGHTS_FILENAME
from loragate.adapters.intake.safetensors_header import SafetensorsError, read_safetensors_header
from loragate.base_model.vi_runs import is_vi_run
from loragate.fetching.json_file import read_json_object

FORMATS = ("peft", "peft-bin", "tinker", "mlx", "vi-run")

# PEFT saves keys with the adapter's name inside (``.lora_A.default.weight``); vLLM wants none.
ADAPTER_NAME = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.default(?=\.|$)")


def detect_format(src_dir: Path) -> str:
    """Name the adapter layout in ``src_dir``: one of ``FORMATS``."""
    if not src_dir.is_dir():
        raise ConversionError(f"{src_dir} is not a directory")
    if is_vi_run(src_dir):
        return "vi-run"
    if (src_dir / MLX_WEIGHTS).is_file():
        return "mlx"
    weights = src_dir / WEIGHTS_FILENAME
    if weights.is_file():
        return "tinker" if _looks_like_tinker(src_dir, weights) else "peft"
    if any((src_dir / name).is_file() for name in BIN_WEIGHTS):
        return "peft-bin"
    found = sorted(p.name for p in src_dir.iterdir())[:12]
    raise ConversionError(
        f"{src_dir} holds no adapter I know (found: {', '.join(found) or 'nothing'}). Expected a "
        f"PEFT adapter ({CONFIG_FILENAME} + {WEIGHTS_FILENAME} or adapter_model.bin), a Tinker "
        f"export, an MLX adapter ({MLX_WEIGHTS}) or a Datature Vi run (model_adapter/)"
    )


def needs_conversion(src_dir: Path) -> bool:
    """False only for a PEFT adapter vLLM loads as it is: plain keys and a complete config.

    Cheap (reads JSON and the safetensors header), so the gateway can skip the converter
    process for the common case.
    """
    if detect_format(src_dir) != "peft" or not already_normal(src_dir / WEIGHTS_FILENAME):
        return True
    config = read_json(src_dir / CONFIG_FILENAME)
    required = ("peft_type", "r", "lora_alpha", "target_modules")
    return any(config.get(field) in (None, "", []) for field in required)


def already_normal(weights: Path) -> bool:
    """True if no tensor name in ``weights`` carries a PEFT adapter name."""
    try:
        names = read_safetensors_header(weights).tensors
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    return not any(ADAPTER_NAME.search(n) for n in names)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; empty when the file is absent."""
    if not path.is_file():
        return {}
    return read_json_object(path, ConversionError, "; fix or re-export it")


def _looks_like_tinker(src_dir: Path, weights: Path) -> bool:
    if (src_dir / TINKER_MARKER).exists():
        return True
    try:
        names = read_safetensors_header(weights).tensors
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    if any(is_tinker_key(n) for n in names):
        return True
    config = read_json(src_dir / CONFIG_FILENAME)
    return bool(config) and "peft_type" not in config and "target_modules" not in config
