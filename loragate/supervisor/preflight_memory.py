"""Whether the model's weights fit: in free GPU memory (each GPU's share under tensor and
pipeline parallelism), or in available host memory for the CPU build."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from loragate.engine_flags import ParallelLayout
from loragate.supervisor.gpu_inventory import GpuInfo
from loragate.supervisor.model_weights import model_weight_bytes
from loragate.supervisor.preflight_problem import PreflightProblem

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
