"""Whether the model fits: a ``MemoryPlan`` says what one model needs on each GPU it uses (or
in host memory, for the CPU build), read from its files and the engine's flags without loading
a weight or touching a GPU, and the checks compare it with what the machine has.

What the plan counts, as vLLM (0.32/0.33) serves a model:

- Float weights in the served dtype: ``--dtype`` when given (``float32`` 4 bytes a parameter,
  ``float16``/``bfloat16`` 2); ``auto`` (the default) serves the checkpoint's ``torch_dtype``,
  except that float32 checkpoints are served in 16 bits (vLLM's ``_resolve_auto_dtype``
  downcasts float32 to the platform's preferred dtype, on GPUs and the CPU build alike).
- A pre-quantized checkpoint (``quantization_config`` in ``config.json``: AWQ, GPTQ, fp8,
  compressed-tensors, ...) as stored: its packed integer and fp8 tensors at their size in the
  safetensors files (the header gives each tensor's dtype and shape); only its float tensors
  (scales, embeddings, norms, often ``lm_head``) in the served dtype.
- ``--quantization`` on a float checkpoint (quantized as it loads): the quantized layers'
  weights at the method's width (fp8 kinds 1 byte a parameter, 4-bit kinds half a byte), the
  embeddings, ``lm_head`` and norms in the served dtype, since vLLM quantizes linear (and MoE)
  layers only; it loads them layer by layer, so the 16-bit checkpoint never sits whole on the
  GPU. The scales (under 1% of the weights) are left to the headroom.
- Headroom for activations, CUDA graphs and the runtime: 10% of the weights plus 1 GiB.
- The KV cache when ``--kv-cache-memory-bytes`` sizes it (per GPU). Without it vLLM gives the
  KV cache what is left of ``--gpu-memory-utilization`` (default 0.9) of each GPU's memory, so
  weights and headroom must fit in that share; with it, vLLM ignores the share when it sizes
  memory, and weights, headroom and KV cache must fit in what is free.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loragate.engine_flags import ParallelLayout, engine_arg_value
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.problem import PreflightProblem

# vLLM's default share of each GPU's memory (``--gpu-memory-utilization``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Weights are not all the engine needs: activations, CUDA graphs and the runtime itself.
_HEADROOM_FRACTION = 0.10
_HEADROOM_BYTES = 1 << 30

_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# ``--dtype`` values and the dtype each serves; anything else is vLLM's ``auto``.
_DTYPE_NAMES = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# ``--quantization`` methods that quantize a float checkpoint as it loads: bits per quantized
# weight, and whether only the MoE experts are quantized (the other linear layers stay float).
# ``fp8`` is vLLM 0.32's deprecated spelling of ``fp8_per_tensor``; ``bitsandbytes`` (4-bit)
# and ``ptpc_fp8`` are older vLLMs'.
_ONLINE_QUANTIZATION: dict[str, tuple[float, bool]] = {
    "fp8": (8, False),
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


@dataclass(frozen=True)
class MemoryPlan:
    """What one model needs of each GPU it runs on (or of host memory on the CPU build), and
    what that figure assumed: computed from the model's files and the engine's flags alone, so
    the preflight and the model catalog can decide where a model fits without a GPU."""

    model_dir: Path
    weights_bytes: int  # all the weights, in the served dtype, before any parallel split
    dtype_bytes: int  # bytes a float weight takes as served
    dtype: str | None = None  # the served float dtype; None when a caller gave only its width
    quantization: str | None = None  # the method, e.g. "fp8" or "awq"
    quantized_by: Literal["--quantization", "checkpoint"] | None = None
    bits: float | None = None  # bits per quantized weight, when known
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    kv_cache_bytes: int | None = None  # --kv-cache-memory-bytes (per GPU)
    # --gpu-memory-utilization; None when the caller had not got the engine's flags (then only
    # what is free counts, as the check did before it read them).
    gpu_memory_utilization: float | None = DEFAULT_GPU_MEMORY_UTILIZATION

    @property
    def split(self) -> int:
        """Into how many parts (one GPU each) tensor and pipeline parallelism cut the weights."""
        return max(self.layout.model_split, 1)

    @property
    def weights_per_gpu(self) -> int:
        return math.ceil(self.weights_bytes / self.split)

    @property
    def headroom_bytes(self) -> int:
        return int(self.weights_per_gpu * _HEADROOM_FRACTION) + _HEADROOM_BYTES

    @property
    def need_per_gpu(self) -> int:
        """Weights, headroom and the KV cache the flags fix, on each GPU the model uses."""
        return self.weights_per_gpu + self.headroom_bytes + (self.kv_cache_bytes or 0)

    def room_on(self, gpu: GpuInfo) -> int:
        """What vLLM may use of ``gpu``: what is free, and unless ``--kv-cache-memory-bytes``
        sizes the cache, no more than the ``--gpu-memory-utilization`` share of its memory."""
        if self.kv_cache_bytes is not None or self.gpu_memory_utilization is None:
            return gpu.free_bytes
        return min(gpu.free_bytes, int(gpu.total_bytes * self.gpu_memory_utilization))

    def fits(self, gpus: Sequence[GpuInfo]) -> bool:
        """Whether each of the first GPUs the layout uses has room for its part."""
        used = gpus[: max(self.layout.local_workers, 1)]
        return bool(used) and all(self.need_per_gpu <= self.room_on(gpu) for gpu in used)

    def describe_weights(self) -> str:
        """The weights' size and what it assumed, e.g. ``7.5 GiB of bfloat16 weights at 2
        bytes per parameter``."""
        size, width = _size(self.weights_bytes), _per_parameter(self.dtype_bytes)
        served = f"{self.dtype} at {width}" if self.dtype else width
        if self.quantized_by == "--quantization":
            _, experts_only = _ONLINE_QUANTIZATION.get(self.quantization or "", (16, False))
            return (
                f"{size} of weights: the {'MoE experts' if experts_only else 'linear layers'} "
                f"at {_per_parameter((self.bits or 16) / 8)} by --quantization "
                f"{self.quantization}, the embeddings and the rest {served}"
            )
        if self.quantized_by == "checkpoint":
            bits = f" {self.bits:g}-bit" if self.bits else ""
            return (
                f"{size} of weights: {self.quantization}{bits} as stored in the checkpoint, "
                f"the float rest {served}"
            )
        return f"{size} of {self.dtype + ' ' if self.dtype else ''}weights at {width}"

    def describe(self) -> str:
        """One line: what the model needs on each GPU, and of what; the start of a refusal."""
        kv = (
            f" and {_size(self.kv_cache_bytes)} of KV cache (--kv-cache-memory-bytes)"
            if self.kv_cache_bytes is not None
            else ""
        )
        if self.split == 1:
            return (
                f"The model in {self.model_dir} needs about {_size(self.need_per_gpu)} "
                f"({self.describe_weights()}, plus {_size(self.headroom_bytes)} of headroom{kv})"
            )
        return (
            f"{self.layout.describe()} cuts the model in {self.model_dir} "
            f"({self.describe_weights()}) into {self.split} parts of about "
            f"{_size(self.weights_per_gpu)}, so each GPU needs about {_size(self.need_per_gpu)} "
            f"with headroom{kv}"
        )


def memory_plan(
    model_dir: Path,
    engine_args: Sequence[str] | None = None,
    *,
    dtype_bytes: int = 2,
    layout: ParallelLayout | None = None,
) -> MemoryPlan | None:
    """The memory plan for the model in ``model_dir`` served with ``engine_args`` (the flags
    after ``--``) under ``layout``; None when its size cannot be told (no weight files and no
    usable ``config.json``) or ``--quantization`` names a method this plan does not know.

    ``engine_args`` None stands for a caller that has not got the engine's flags: float
    weights then count ``dtype_bytes`` each, only the checkpoint's own quantization counts, and
    each GPU's room is what is free (no ``--gpu-memory-utilization`` share).
    """
    if not model_dir.is_dir():
        return None
    config = _read_json(model_dir / "config.json")
    args = list(engine_args or [])
    if engine_args is None:
        dtype = None
    else:
        dtype = served_dtype(config, args)
        dtype_bytes = _DTYPE_BYTES[dtype]
    quantization: str | None = None
    quantized_by: Literal["--quantization", "checkpoint"] | None = None
    bits: float | None = None
    online: tuple[float, bool] | None = None
    stored = _checkpoint_quantization(config)
    flagged = engine_arg_value(args, "--quantization", ("-q",))
    if stored is not None:  # the checkpoint's own quantization wins over the flag's
        (quantization, bits), quantized_by = stored, "checkpoint"
        if bits is None and not _weight_files(model_dir):
            return None  # nothing tells the width of its weights
    elif flagged is not None:
        if flagged not in _ONLINE_QUANTIZATION:
            return None
        online = _ONLINE_QUANTIZATION[flagged]
        quantization, quantized_by, bits = flagged, "--quantization", online[0]
    checkpoint_bits = bits if quantized_by == "checkpoint" else None
    weights = _weights_bytes(model_dir, config, dtype_bytes, online, checkpoint_bits)
    if weights is None:
        return None
    share = (
        None
        if engine_args is None
        else _parse_share(engine_arg_value(args, "--gpu-memory-utilization"))
    )
    return MemoryPlan(
        model_dir=model_dir,
        weights_bytes=weights,
        dtype_bytes=dtype_bytes,
        dtype=dtype,
        layout=layout or ParallelLayout(),
        kv_cache_bytes=_parse_bytes(engine_arg_value(args, "--kv-cache-memory-bytes")),
        gpu_memory_utilization=share,
        quantization=quantization,
        quantized_by=quantized_by,
        bits=bits,
    )


def served_dtype(config: dict[str, Any], engine_args: Sequence[str]) -> str:
    """The float dtype vLLM serves the weights in: ``--dtype``, else (``auto``) the
    checkpoint's ``torch_dtype``, with float32 checkpoints (or none named) served as
    bfloat16 (float16 on GPUs without bfloat16: the same width)."""
    chosen = engine_arg_value(list(engine_args), "--dtype")
    if chosen is not None and chosen.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[chosen.lower()]
    text = _text_config(config)
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
    return _weights_bytes(model_dir, _read_json(model_dir / "config.json"), dtype_bytes, None, None)


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))


def _weights_bytes(
    model_dir: Path,
    config: dict[str, Any],
    dtype_bytes: int,
    online: tuple[float, bool] | None,
    checkpoint_bits: float | None,
) -> int | None:
    """The weights as loaded: from the safetensors headers, else ``.bin`` files as stored (no
    header tells their dtypes), else estimated from the config's parameter counts."""
    files = _weight_files(model_dir)
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


def _safetensors_loaded_bytes(
    path: Path, dtype_bytes: int, online: tuple[float, bool] | None
) -> int | None:
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


def _checkpoint_quantization(config: dict[str, Any]) -> tuple[str, float | None] | None:
    """The checkpoint's own quantization (``quantization_config``): its method and bits."""
    settings = config.get("quantization_config") or _text_config(config).get("quantization_config")
    if not isinstance(settings, dict):
        return None
    method = str(settings.get("quant_method") or "quantized")
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


def _config_parameters(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """A decoder-only transformer's parameters from its config (vision towers not counted):
    embeddings and output head, dense linear layers, MoE experts."""
    text = _text_config(config)
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
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    embeddings = vocab * hidden * (1 if tied else 2)
    if experts > 1:
        return embeddings, layers * attention, layers * 3 * hidden * expert_intermediate * experts
    return embeddings, layers * (attention + 3 * hidden * intermediate), 0


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _parse_bytes(value: str | None) -> int | None:
    """``--kv-cache-memory-bytes`` as vLLM reads it: ``2000000000``, ``2g`` (decimal) or
    ``2G`` (binary); None when absent or unreadable (the engine then says what is wrong)."""
    if value is None:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", value.strip())
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix.isupper():
        return int(float(number) * (1 << (10 * "KMGT".index(suffix) + 10)))
    scale = 10 ** (3 * "kmgt".index(suffix) + 3) if suffix else 1
    return int(float(number) * scale)


def _parse_share(value: str | None) -> float:
    try:
        share = float(value) if value is not None else DEFAULT_GPU_MEMORY_UTILIZATION
    except ValueError:
        return DEFAULT_GPU_MEMORY_UTILIZATION
    return share if 0 < share <= 1 else DEFAULT_GPU_MEMORY_UTILIZATION


def _size(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.0f} MiB"


def _per_parameter(nbytes: float) -> str:
    return f"{nbytes:g} byte{'' if nbytes == 1 else 's'} per parameter"


def check_memory(
    model_dir: Path,
    dtype_bytes: int,
    available: int,
    runs_on: Literal["gpu", "cpu"],
    *,
    engine_args: Sequence[str] | None = None,
) -> PreflightProblem | None:
    """Whether the model's plan fits in ``available`` bytes (host memory for the CPU build)."""
    plan = memory_plan(model_dir, engine_args, dtype_bytes=dtype_bytes)
    if plan is None or plan.need_per_gpu <= available:
        return None
    where = "free GPU memory" if runs_on == "gpu" else "available host memory"
    more = ", or spread it over GPUs with --tensor-parallel-size N" if runs_on == "gpu" else ""
    kv = "lower --kv-cache-memory-bytes, " if plan.kv_cache_bytes is not None else ""
    return PreflightProblem(
        "memory",
        f"{plan.describe()} but only {_size(available)} of {where} is left: {kv}free some "
        f"memory, or pick a smaller or quantized model{more}.",
    )


def check_gpu_memory(
    model_dir: Path,
    dtype_bytes: int,
    gpus: list[GpuInfo],
    layout: ParallelLayout,
    *,
    engine_args: Sequence[str] | None = None,
) -> PreflightProblem | None:
    """Whether each GPU the engine uses has room for its part of the model's plan: tensor and
    pipeline parallelism cut the weights in ``model_split`` parts (about evenly), one per GPU;
    the refusal's numbers are the plan's (``MemoryPlan.describe``)."""
    plan = memory_plan(model_dir, engine_args, dtype_bytes=dtype_bytes, layout=layout)
    used = gpus[: max(layout.local_workers, 1)]
    if plan is None or not used or plan.fits(used):
        return None
    tightest = min(used, key=plan.room_on)
    room = plan.room_on(tightest)
    on = f"GPU {tightest.index} ({tightest.name})"
    capped = room < tightest.free_bytes  # the share vLLM may take is the limit, not what is free
    share = (
        f"vLLM may take only {_size(room)} of {on} ({plan.gpu_memory_utilization or 1:g} of its "
        f"{_size(tightest.total_bytes)}, --gpu-memory-utilization)"
    )
    kv = "lower --kv-cache-memory-bytes, " if plan.kv_cache_bytes is not None else ""
    # A larger share helps only where what is free would hold the need.
    share_needed = math.ceil(100 * plan.need_per_gpu / max(tightest.total_bytes, 1)) / 100
    raise_share = (
        f"raise --gpu-memory-utilization to {share_needed:g} after --, or "
        if capped and plan.need_per_gpu <= tightest.free_bytes and share_needed <= 1
        else ""
    )
    first = kv + raise_share
    quantize = (
        ""
        if plan.quantization
        else ", or quantize it as it loads (--quantization fp8_per_tensor after --)"
    )
    if plan.split == 1:
        lack = share if capped else f"only {_size(room)} of free GPU memory is left on {on}"
        free = "" if capped else "free some memory, or "
        return PreflightProblem(
            "memory",
            f"{plan.describe()} but {lack}: {first}{free}pick a smaller or quantized "
            f"model{quantize}, or spread it over GPUs with --tensor-parallel-size N.",
        )
    lack = share if capped else f"{on} has only {_size(room)} free"
    free = "" if capped else "free some GPU memory, "
    return PreflightProblem(
        "memory",
        f"{plan.describe()}, but {lack}: {first}{free}spread the model over more GPUs, or pick "
        f"a smaller or quantized model{quantize}.",
    )
