"""What one model's weights take, and whether they fit in host memory: a ``MemoryPlan`` says
what a model needs, read from its files and the engine's flags without loading a weight
(``model_files`` has the rules for the weights' bytes). The GPU's rules, which vLLM checks at
each boot (the share, one full sequence of KV cache, the CUDA context), are
``loragate.plan.gpu``'s, built on this plan's weights; ``check_memory`` is the CPU build's
check.

For host memory the plan counts the weights in their served dtype, headroom for activations
and the runtime (10% of the weights plus 1 GiB), and the KV cache when
``--kv-cache-memory-bytes`` sizes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from loragate.engine_flags import ParallelLayout, engine_arg_value
from loragate.plan.preflight.model_files import (
    DTYPE_BYTES,
    ONLINE_QUANTIZATION,
    checkpoint_quantization,
    read_json,
    served_dtype,
    weight_files,
    weights_bytes,
)
from loragate.plan.preflight.problem import PreflightProblem

# Weights are not all the engine needs: activations and the runtime itself.
_HEADROOM_FRACTION = 0.10
_HEADROOM_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """What one model's weights take (and, on the CPU build, what it needs of host memory),
    and what that figure assumed: computed from the model's files and the engine's flags
    alone, so the preflight, the GPU plan and the catalog can size a model without a GPU."""

    model_dir: Path
    weights_bytes: int  # all the weights, in the served dtype, before any parallel split
    dtype_bytes: int  # bytes a float weight takes as served
    dtype: str | None = None  # the served float dtype; None when a caller gave only its width
    quantization: str | None = None  # the method, e.g. "fp8" or "awq"
    quantized_by: Literal["--quantization", "checkpoint"] | None = None
    bits: float | None = None  # bits per quantized weight, when known
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    kv_cache_bytes: int | None = None  # --kv-cache-memory-bytes (per GPU)

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
        """Weights, headroom and the KV cache the flags fix: the host-memory need."""
        return self.weights_per_gpu + self.headroom_bytes + (self.kv_cache_bytes or 0)

    def describe_weights(self) -> str:
        """The weights' size and what it assumed, e.g. ``7.5 GiB of bfloat16 weights at 2
        bytes per parameter``."""
        weights, width = size(self.weights_bytes), _per_parameter(self.dtype_bytes)
        served = f"{self.dtype} at {width}" if self.dtype else width
        if self.quantized_by == "--quantization":
            _, experts_only = ONLINE_QUANTIZATION.get(self.quantization or "", (16, False))
            return (
                f"{weights} of weights: the "
                f"{'MoE experts' if experts_only else 'linear layers'} at "
                f"{_per_parameter((self.bits or 16) / 8)} by --quantization "
                f"{self.quantization}, the embeddings and the rest {served}"
            )
        if self.quantized_by == "checkpoint":
            bits = f" {self.bits:g}-bit" if self.bits else ""
            return (
                f"{weights} of weights: {self.quantization}{bits} as stored in the checkpoint, "
                f"the float rest {served}"
            )
        return f"{weights} of {self.dtype + ' ' if self.dtype else ''}weights at {width}"

    def describe(self) -> str:
        """One line: what the model needs of host memory, and of what."""
        kv = (
            f" and {size(self.kv_cache_bytes)} of KV cache (--kv-cache-memory-bytes)"
            if self.kv_cache_bytes is not None
            else ""
        )
        return (
            f"The model in {self.model_dir} needs about {size(self.need_per_gpu)} "
            f"({self.describe_weights()}, plus {size(self.headroom_bytes)} of headroom{kv})"
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
    usable ``config.json``) or ``--quantization`` names a method of unknown width. Whether
    vLLM takes the method at all is ``loragate.plan.gpu.need.quantization_refusal``'s say.

    ``engine_args`` None stands for a caller that has not got the engine's flags: float
    weights then count ``dtype_bytes`` each, and only the checkpoint's own quantization counts.
    """
    if not model_dir.is_dir():
        return None
    config = read_json(model_dir / "config.json")
    args = list(engine_args or [])
    if engine_args is None:
        dtype = None
    else:
        dtype = served_dtype(config, args)
        dtype_bytes = DTYPE_BYTES[dtype]
    quantization: str | None = None
    quantized_by: Literal["--quantization", "checkpoint"] | None = None
    bits: float | None = None
    online: tuple[float, bool] | None = None
    stored = checkpoint_quantization(config)
    flagged = engine_arg_value(args, "--quantization", ("-q",))
    if stored is not None:  # vLLM takes only the checkpoint's own (config/model.py:1443)
        (quantization, bits), quantized_by = stored, "checkpoint"
        if bits is None and not weight_files(model_dir):
            return None  # nothing tells the width of its weights
    elif flagged is not None:
        if flagged not in ONLINE_QUANTIZATION:
            return None
        online = ONLINE_QUANTIZATION[flagged]
        quantization, quantized_by, bits = flagged, "--quantization", online[0]
    checkpoint_bits = bits if quantized_by == "checkpoint" else None
    weights = weights_bytes(model_dir, config, dtype_bytes, online, checkpoint_bits)
    if weights is None:
        return None
    return MemoryPlan(
        model_dir=model_dir,
        weights_bytes=weights,
        dtype_bytes=dtype_bytes,
        dtype=dtype,
        layout=layout or ParallelLayout(),
        kv_cache_bytes=parse_bytes(engine_arg_value(args, "--kv-cache-memory-bytes")),
        quantization=quantization,
        quantized_by=quantized_by,
        bits=bits,
    )


def parse_bytes(value: str | None) -> int | None:
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


def size(nbytes: float) -> str:
    """``7.5 GiB``, ``640 MiB``: a size as the plan's sentences say it."""
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
        f"{plan.describe()} but only {size(available)} of {where} is left: {kv}free some "
        f"memory, or pick a smaller or quantized model{more}.",
    )
