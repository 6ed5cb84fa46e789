"""What a model's files say about its size, read without loading a weight: its shape from
``config.json`` (layers, heads, the longest sequence) and its weights' bytes as vLLM will hold
them, from the safetensors headers (each tensor's name, dtype and shape).

The rules, as vLLM (0.32/0.33) serves a model:

- Float weights in the served dtype: ``--dtype`` when given (``float32`` 4 bytes a parameter,
  ``float16``/``bfloat16`` 2); ``auto`` (the default) serves the checkpoint's ``torch_dtype``,
  except that float32 checkpoints are served in 16 bits (vLLM's ``_resolve_auto_dtype``
  downcasts float32 to the platform's preferred dtype, on GPUs and the CPU build alike).
- A pre-quantized checkpoint (``quantization_config`` in ``config.json``: AWQ, GPTQ, fp8,
  compressed-tensors, ...) as stored: its packed integer and fp8 tensors at their size in the
  safetensors files; only its float tensors (scales, embeddings, norms, often ``lm_head``) in
  the served dtype.
- ``--quantization`` on a float checkpoint (quantized as it loads): the quantized layers'
  weights at the method's width (fp8 kinds 1 byte a parameter, 4-bit kinds half a byte), the
  embeddings, ``lm_head`` and norms in the served dtype, since vLLM quantizes linear (and MoE)
  layers only; it loads them layer by layer, so the 16-bit checkpoint never sits whole on the
  GPU. The scales (under 1% of the weights) are left to the engine's allowance.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.engine_flags import engine_arg_value

_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# ``--dtype`` values and the dtype each serves; anything else is vLLM's ``auto``.
DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# ``--quantization`` methods that quantize a float checkpoint as it loads: bits per quantized
# weight, and whether only the MoE experts are quantized (the other linear layers stay float).
# Whether the installed vLLM takes a method at all is its own list's say
# (``loragate.plan.gpu.vllm_rules.accepted_quantization``): vLLM 0.32 dropped ``bitsandbytes``
# and ``ptpc_fp8``, kept here for the vLLMs that still take them.
ONLINE_QUANTIZATION: dict[str, tuple[float, bool]] = {
    "fp8": (8, False),  # 0.32: the deprecated spelling of fp8_per_tensor on a float checkpoint
    "fp8_per_tensor": (8, False),
    "fp8_per_block": (8, False),
    "fp8_per_channel": (8, False),
    "fbgemm_fp8": (8, False),
    "ptpc_fp8": (8, False),
    "mxfp8": (8, False),
    "mxfp4": (4, False),
    "bitsandbytes": (4, False),
    "experts_int8": (8, True),
    "int8_per_channel_weight_only": (8, True),
    "nvfp4_per_token": (4, True),
}
# Tensors that online quantization leaves in the served dtype beside the 1-D ones (norms,
# biases): token and position embeddings and the output head (vLLM's ParallelLMHead is an
# embedding, not a linear layer).
_NOT_QUANTIZED_ONLINE = ("embed", "lm_head", "wte", "wpe")
# Where a config names the longest sequence, as vLLM reads it (the smallest one present wins):
# vllm/transformers_utils/model_arch_config_convertor.py:396-413.
MAX_LEN_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)  # fmt: skip
# RoPE scalings whose factor vLLM multiplies the length by (vllm/config/model.py:2593-2616:
# every type but these, which leave max_position_embeddings already scaled).
_ROPE_ALREADY_SCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                        "deepseek_llama_scaling", "default")  # fmt: skip
_DEFAULT_MAX_LEN = 2048  # vllm/config/model.py:2577, when no key is there


@dataclass(frozen=True)
class ModelShape:
    """A decoder's dimensions, from its ``config.json`` (the text part of a vision model)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # MLA (DeepSeek): one latent of this width plus the rotary part per token and layer,
    # shared by every head instead of a key and a value per KV head.
    kv_lora_rank: int | None = None
    rope_head_dim: int = 0

    def kv_elements_per_layer_token(self, tensor: int = 1) -> int:
        """KV cache elements one token takes in one attention layer on one GPU: its keys and
        values for the KV heads there. Tensor parallelism splits the heads (never below one a
        GPU: vllm/config/model.py:1670); MLA keeps one latent shared by every head."""
        if self.kv_lora_rank is not None:
            return self.kv_lora_rank + self.rope_head_dim
        heads = max(1, self.kv_heads // max(tensor, 1))
        return 2 * heads * self.head_dim

    @property
    def linear_in_out(self) -> int:
        """The inputs plus outputs of one layer's seven projections (q, k, v, o, gate, up,
        down): what a LoRA of rank 1 on all of them holds, per layer."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)


# What transformers' config classes fill in where a family's config.json leaves it out (Gemma
# 3's hub configs name neither heads nor length: transformers' Gemma3TextConfig defaults).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131072, "vocab_size": 262208,
    },
}  # fmt: skip


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (a vision model's ``text_config``), with what its transformers
    config class would fill in where the file leaves it out."""
    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) else config
    defaults = _FAMILY_DEFAULTS.get(str(text.get("model_type") or ""))
    return {**defaults, **text} if defaults else text


def model_shape(config: dict[str, Any]) -> ModelShape | None:
    """The decoder's dimensions; None when ``config.json`` lacks them (no guess at heads)."""
    text = text_config(config)
    try:
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        rank = text.get("kv_lora_rank")
        return ModelShape(
            layers=int(text["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text.get("intermediate_size") or 4 * hidden),
            vocab=int(text.get("vocab_size") or 0),
            kv_lora_rank=int(rank) if rank else None,
            rope_head_dim=int(text.get("qk_rope_head_dim") or 0),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def derived_max_len(
    config: dict[str, Any],
    tokenizer_config: dict[str, Any] | None = None,
    *,
    pooling: bool = False,
) -> int:
    """The longest sequence vLLM serves the model at when ``--max-model-len`` is not given:
    the smallest length key of the config times a RoPE scaling factor that has not scaled it
    already (vllm/config/model.py:2527-2634). The tokenizer's ``model_max_length`` caps it
    only for a pooling model with absolute position embeddings: vLLM reads the tokenizer's
    config for no other (config/model.py:2131-2141)."""
    text = text_config(config)
    found = [
        int(value)
        for key in MAX_LEN_KEYS
        if isinstance(value := text.get(key, config.get(key)), int | float) and value > 0
    ]
    length: float = min(found) if found else math.inf
    absolute = config.get("position_embedding_type") == "absolute"
    limit = (tokenizer_config or {}).get("model_max_length") if pooling and absolute else None
    if isinstance(limit, int | float) and limit > 0:
        length = min(length, limit)
    if length == math.inf:
        return _DEFAULT_MAX_LEN
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    family = str(text.get("model_type") or config.get("model_type") or "")
    if isinstance(rope, dict) and "gemma3" not in family:
        kind = rope.get("rope_type") or rope.get("type") or "default"
        factor = rope.get("factor")
        if kind not in _ROPE_ALREADY_SCALED and isinstance(factor, int | float) and factor > 0:
            length *= factor
        if kind == "longrope" and isinstance(text.get("original_max_position_embeddings"), int):
            return int(text["original_max_position_embeddings"])
    return int(length)


def served_dtype(config: dict[str, Any], engine_args: Sequence[str]) -> str:
    """The float dtype vLLM serves the weights in: ``--dtype``, else (``auto``) the
    checkpoint's ``torch_dtype``, with float32 checkpoints (or none named) served as
    bfloat16 (float16 on GPUs without bfloat16: the same width)."""
    chosen = engine_arg_value(list(engine_args), "--dtype")
    if chosen is not None and chosen.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[chosen.lower()]
    text = text_config(config)
    named_by = ("torch_dtype", "dtype")
    for named in [text.get(key) for key in named_by] + [config.get(key) for key in named_by]:
        if named in ("float16", "bfloat16"):
            return str(named)
    return "bfloat16"


def model_weight_bytes(model_dir: Path, dtype_bytes: int) -> int | None:
    """About how many bytes the model's weights take once loaded; None when unknown.

    Floating-point safetensors count ``dtype_bytes`` per parameter (the engine casts them);
    quantized tensors and ``.bin`` files count as stored. Without weight files, the parameter
    count is estimated from ``config.json``.
    """
    if not model_dir.is_dir():
        return None
    return weights_bytes(model_dir, read_json(model_dir / "config.json"), dtype_bytes, None, None)


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))


def weights_bytes(
    model_dir: Path,
    config: dict[str, Any],
    dtype_bytes: int,
    online: tuple[float, bool] | None,
    checkpoint_bits: float | None,
) -> int | None:
    """The weights as loaded: from the safetensors headers, else ``.bin`` files as stored (no
    header tells their dtypes), else estimated from the config's parameter counts."""
    files = weight_files(model_dir)
    if files:
        total = 0
        for path in files:
            loaded = None
            if path.suffix == ".safetensors":
                loaded = _safetensors_loaded_bytes(path, dtype_bytes, online)
            total += loaded if loaded is not None else path.stat().st_size
        return total
    counts = _config_parameters(config)
    if counts is None:
        return None
    embeddings, dense, experts = counts
    if checkpoint_bits is not None:
        return int(embeddings * dtype_bytes + (dense + experts) * checkpoint_bits / 8)
    if online is not None:
        bits, experts_only = online
        dense_bytes = dtype_bytes if experts_only else bits / 8
        return int(embeddings * dtype_bytes + dense * dense_bytes + experts * bits / 8)
    return (embeddings + dense + experts) * dtype_bytes


def safetensors_header(path: Path) -> dict[str, Any] | None:
    """The file's JSON header (8-byte little-endian length, then the JSON naming every
    tensor); None when it is not one. Only the header is read: the data may be a hole."""
    try:
        with path.open("rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                return None
            (length,) = struct.unpack("<Q", prefix)
            if not 0 < length <= _SAFETENSORS_MAX_HEADER:
                return None
            header = json.loads(file.read(length))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _safetensors_loaded_bytes(
    path: Path, dtype_bytes: int, online: tuple[float, bool] | None
) -> int | None:
    header = safetensors_header(path)
    if header is None:
        return None
    total = 0.0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            return None
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if info.get("dtype") in _FLOAT_DTYPES and isinstance(shape, list):
            if not all(isinstance(dim, int) for dim in shape):
                return None
            width: float = dtype_bytes
            if online is not None and _quantized_online(name, shape, experts_only=online[1]):
                width = online[0] / 8
            total += math.prod(shape) * width
        elif isinstance(offsets, list) and len(offsets) == 2:
            if not all(isinstance(offset, int) for offset in offsets):
                return None
            total += offsets[1] - offsets[0]
        else:
            return None
    return math.ceil(total)


def _quantized_online(name: str, shape: list[int], *, experts_only: bool) -> bool:
    """Whether ``--quantization`` quantizes this float tensor: a weight matrix of a linear or
    MoE layer (embeddings, the output head, norms and biases stay in the served dtype)."""
    lowered = name.lower()
    if len(shape) < 2 or any(part in lowered for part in _NOT_QUANTIZED_ONLINE):
        return False
    return not experts_only or ("experts" in lowered and "shared_expert" not in lowered)


def checkpoint_quantization(config: dict[str, Any]) -> tuple[str, float | None] | None:
    """The checkpoint's own quantization (``quantization_config``): its method and bits."""
    settings = quantization_settings(config)
    if settings is None:
        return None
    method = str(settings.get("quant_method") or "quantized").lower()
    for key in ("bits", "w_bit", "weight_bits", "num_bits"):
        if isinstance(settings.get(key), int | float):
            return method, float(settings[key])
    groups = settings.get("config_groups")
    if isinstance(groups, dict):  # compressed-tensors: each group's weights say their bits
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
                return method, float(weights["num_bits"])
    if "fp8" in method:
        return method, 8.0
    if "fp4" in method:
        return method, 4.0
    return method, None


def quantization_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` (or compressed-tensors' older
    ``compression_config``), from the config or its ``text_config``, as vLLM looks for it
    (transformers_utils/model_arch_config_convertor.py:263-310)."""
    for where in (config, text_config(config)):
        for key in ("quantization_config", "compression_config"):
            if isinstance(where.get(key), dict):
                return dict(where[key])
    return None


def _config_parameters(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """A decoder-only transformer's parameters from its config (vision towers not counted):
    embeddings and output head, dense linear layers, MoE experts."""
    text = text_config(config)
    shape = model_shape(config)
    try:
        experts = int(
            text.get("num_local_experts")
            or text.get("num_experts")
            or text.get("n_routed_experts")
            or 1
        )
        expert_intermediate = int(text.get("moe_intermediate_size") or 0)
    except (TypeError, ValueError):
        return None
    if shape is None or not shape.vocab:
        return None
    hidden, layers = shape.hidden, shape.layers
    attention = 2 * hidden * (shape.heads + shape.kv_heads) * shape.head_dim
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    embeddings = shape.vocab * hidden * (1 if tied else 2)
    if experts > 1:
        per_expert = 3 * hidden * (expert_intermediate or shape.intermediate)
        return embeddings, layers * attention, layers * per_expert * experts
    return embeddings, layers * (attention + 3 * hidden * shape.intermediate), 0


def read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
