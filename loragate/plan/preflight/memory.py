"""Whether the model's weights fit: in free GPU memory (each GPU's share under tensor and
pipeline parallelism), or in available host memory for the CPU build."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Literal

from loragate.engine_flags import ParallelLayout
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.problem import PreflightProblem

# About how many bytes a model's weights take once the engine has loaded them, read from its
# files without loading any (safetensors headers, else ``config.json``).
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def model_weight_bytes(model_dir: Path, dtype_bytes: int) -> int | None:
    """About how many bytes the model's weights take once loaded; None when unknown.

    Floating-point safetensors count ``dtype_bytes`` per parameter (the engine casts them);
    quantized tensors and ``.bin`` files count as stored. Without weight files, the parameter
    count is estimated from ``config.json``.
    """
    if not model_dir.is_dir():
        return None
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if files:
        total = 0
        for path in files:
            loaded = None
            if path.suffix == ".safetensors":
                loaded = _safetensors_loaded_bytes(path, dtype_bytes)
            total += loaded if loaded is not None else path.stat().st_size
        return total
    parameters = _config_parameter_count(model_dir / "config.json")
    return None if parameters is None else parameters * dtype_bytes


def _safetensors_loaded_bytes(path: Path, dtype_bytes: int) -> int | None:
    # The format: 8-byte little-endian header length, then a JSON header naming every tensor.
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
    if not isinstance(header, dict):
        return None
    total = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            return None
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if info.get("dtype") in _FLOAT_DTYPES and isinstance(shape, list):
            if not all(isinstance(dim, int) for dim in shape):
                return None
            total += math.prod(shape) * dtype_bytes
        elif isinstance(offsets, list) and len(offsets) == 2:
            if not all(isinstance(offset, int) for offset in offsets):
                return None
            total += offsets[1] - offsets[0]
        else:
            return None
    return total


def _config_parameter_count(path: Path) -> int | None:
    """A decoder-only transformer's parameter count from its config (vision towers not counted)."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        vocab = int(text["vocab_size"])
        heads = int(text.get("num_attention_heads") or 1)
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        intermediate = int(text.get("intermediate_size") or 4 * hidden)
        experts = int(
            text.get("num_local_experts")
            or text.get("num_experts")
            or text.get("n_routed_experts")
            or 1
        )
        expert_intermediate = int(text.get("moe_intermediate_size") or intermediate)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * (expert_intermediate * experts if experts > 1 else intermediate)
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * (attention + mlp) + embeddings


# Weights are not all the engine needs: activations, KV cache and the runtime itself.
_MEMORY_MARGIN_FRACTION = 0.10
_MEMORY_MARGIN_BYTES = 1 << 30


def _size(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.0f} MiB"


def check_memory(
    model_dir: Path, dtype_bytes: int, available: int, runs_on: Literal["gpu", "cpu"]
) -> PreflightProblem | None:
    weights = model_weight_bytes(model_dir, dtype_bytes)
    if weights is None:
        return None
    needed = int(weights * (1 + _MEMORY_MARGIN_FRACTION)) + _MEMORY_MARGIN_BYTES
    if needed <= available:
        return None
    where = "free GPU memory" if runs_on == "gpu" else "available host memory"
    more = ", or spread it over GPUs with --tensor-parallel-size N" if runs_on == "gpu" else ""
    return PreflightProblem(
        "memory",
        f"The model in {model_dir} needs about {_size(needed)} ({_size(weights)} of weights at "
        f"{dtype_bytes} bytes per parameter, plus headroom) but only {_size(available)} of "
        f"{where} is left: free some memory, or pick a smaller or quantized model{more}.",
    )


def check_gpu_memory(
    model_dir: Path, dtype_bytes: int, gpus: list[GpuInfo], layout: ParallelLayout
) -> PreflightProblem | None:
    """Whether each GPU the engine uses has room for its part of the weights: tensor and
    pipeline parallelism cut them in ``model_split`` parts (about evenly), one per GPU."""
    weights = model_weight_bytes(model_dir, dtype_bytes)
    used = gpus[: max(layout.local_workers, 1)]
    if weights is None or not used:
        return None
    split = layout.model_split
    share = weights / split
    needed = int(share * (1 + _MEMORY_MARGIN_FRACTION)) + _MEMORY_MARGIN_BYTES
    tightest = min(used, key=lambda gpu: gpu.free_bytes)
    if needed <= tightest.free_bytes:
        return None
    on = f"GPU {tightest.index} ({tightest.name})"
    if split == 1:
        return PreflightProblem(
            "memory",
            f"The model in {model_dir} needs about {_size(needed)} ({_size(weights)} of weights "
            f"at {dtype_bytes} bytes per parameter, plus headroom) but only "
            f"{_size(tightest.free_bytes)} of free GPU memory is left on {on}: free some "
            "memory, or pick a smaller or quantized model, or spread it over GPUs with "
            "--tensor-parallel-size N.",
        )
    return PreflightProblem(
        "memory",
        f"{layout.describe()} cuts the model in {model_dir} ({_size(weights)} of weights at "
        f"{dtype_bytes} bytes per parameter) into {split} parts of about {_size(share)}, so "
        f"each GPU needs about {_size(needed)} with headroom, but {on} has only "
        f"{_size(tightest.free_bytes)} free: free some GPU memory, spread the model over more "
        "GPUs, or pick a smaller or quantized model.",
    )
