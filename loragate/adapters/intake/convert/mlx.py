"""``mlx``: ``adapters.safetensors`` with ``lora_a`` (in, r) / ``lora_b`` (r, out) keys and
``lora_parameters {rank, scale}`` in ``adapter_config.json``; PEFT keeps the transposes and
scales by ``lora_alpha / r``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.tensors import Tensors, load_safetensors
from loragate.adapters.intake.peft_layout import KEY_PREFIX

MLX_WEIGHTS = "adapters.safetensors"
MLX_DEFAULT_SCALE = 20.0  # mlx-lm's default lora_parameters.scale

_MLX_KEY = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_[ab])$")


def load_mlx(src_dir: Path) -> Tensors:
    return load_safetensors(src_dir / MLX_WEIGHTS)


def from_mlx(tensors: Tensors) -> Tensors:
    """MLX's LoRA tensors under PEFT's names and orientation."""
    out: Tensors = {}
    for name, tensor in tensors.items():
        match = _MLX_KEY.match(name)
        if match is None:
            raise ConversionError(
                f"MLX tensor {name!r} is not a LoRA weight (expected '<module>.lora_a' / "
                "'.lora_b'); DoRA and fully trained layers cannot be served as a LoRA"
            )
        module, side = match["module"], match["ab"][-1].upper()
        if tensor.dim() != 2:
            raise ConversionError(
                f"MLX tensor {name!r} has shape {list(tensor.shape)}, not a matrix"
            )
        if module.endswith("embed_tokens"):
            # MLX keeps (num_embeddings, r) / (r, dims); PEFT's embedding LoRA is the transpose.
            key = f"{KEY_PREFIX}{module}.lora_embedding_{side}"
        else:
            key = f"{KEY_PREFIX}{module}.lora_{side}.weight"
        out[key] = tensor.T.contiguous()
    return out


def mlx_config_fields(src_config: dict[str, Any], ranks: dict[str, int]) -> dict[str, Any]:
    """``r`` and ``lora_alpha`` for PEFT from an MLX config's ``lora_parameters``."""
    if src_config.get("fine_tune_type", "lora") != "lora" or src_config.get("use_dora"):
        raise ConversionError(
            f"the MLX adapter is a {src_config.get('fine_tune_type', 'dora')} fine-tune; only "
            "LoRA adapters can be served (retrain with fine_tune_type: lora)"
        )
    params = src_config.get("lora_parameters") or {}
    rank = int(params.get("rank") or max(ranks.values()))
    scale = float(params.get("scale", MLX_DEFAULT_SCALE))
    alpha = scale * rank
    # PEFT scales by lora_alpha / r; MLX by scale. Keep an int when it is one, like PEFT writes.
    return {"r": rank, "lora_alpha": int(alpha) if alpha.is_integer() else alpha}
