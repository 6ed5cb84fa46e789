"""An all-zero LoRA for the served base model, written without torch.

Base-model requests routed through it compute exactly the base model's output, but they
occupy a real LoRA slot. That matters on vLLM's CPU build, where a request with no adapter
gets slot index -1 and Python indexing hands it the *last* slot's weights (another
adapter's). With every request on a real slot, no request can borrow another's weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

ZERO_ADAPTER_RANK = 1


def _safetensors_bytes(tensors: dict[str, tuple[int, int]]) -> bytes:
    """A safetensors file of float32 zero matrices with the given (rows, cols) shapes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (rows, cols) in tensors.items():
        size = rows * cols * 4
        header[name] = {
            "dtype": "F32",
            "shape": [rows, cols],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def write_zero_adapter(base_config: dict[str, Any], out: Path) -> Path:
    """Write a rank-1 all-zero LoRA on every layer's ``q_proj`` of a Llama-like base model."""
    text_config = base_config.get("text_config") or base_config
    hidden = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    head_dim = int(text_config.get("head_dim") or hidden // heads)
    layers = int(text_config["num_hidden_layers"])
    if "text_config" not in base_config:
        prefix = "base_model.model.model"
    elif base_config.get("model_type") == "idefics3":
        prefix = "base_model.model.model.text_model"
    else:
        prefix = "base_model.model.model.language_model"
    tensors: dict[str, tuple[int, int]] = {}
    for layer in range(layers):
        module = f"{prefix}.layers.{layer}.self_attn.q_proj"
        tensors[f"{module}.lora_A.weight"] = (ZERO_ADAPTER_RANK, hidden)
        tensors[f"{module}.lora_B.weight"] = (heads * head_dim, ZERO_ADAPTER_RANK)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(_safetensors_bytes(tensors))
    config = {
        "peft_type": "LORA",
        "r": ZERO_ADAPTER_RANK,
        "lora_alpha": ZERO_ADAPTER_RANK,
        "target_modules": ["q_proj"],
        "bias": "none",
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_config.get("_name_or_path", "")),
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
