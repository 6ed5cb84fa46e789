"""What the machine offers an engine, read without loading CUDA (not NVML or torch): the NVIDIA
GPUs this process may use and their free memory (``nvidia-smi``), and the NUMA nodes vLLM's CPU
build binds a worker to each of; and running such a probe without letting a hung or missing
program stop the gateway's start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Running a short command for a preflight check (the engine's Python, ``nvidia-smi``) without
# letting a hung or missing program stop the gateway's start.
# How long the engine's Python may take to answer (importlib lookups, no vLLM import).
ENGINE_PYTHON_TIMEOUT = 60.0


def run_probe(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | str:
    """The finished process, or why it could not run."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


# NUMA nodes this process may run on: vLLM's CPU build binds one worker to each.
def numa_node_count() -> int:
    """NUMA nodes with a CPU this process may run on (vLLM's CPU build binds one worker to each)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    nodes = 0
    for cpulist in Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"):
        with contextlib.suppress(OSError, ValueError):
            if _cpu_ids(cpulist.read_text()) & allowed:
                nodes += 1
    return max(nodes, 1)


def _cpu_ids(text: str) -> set[int]:
    ids: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            ids.update(range(int(low), int(high) + 1))
        elif part:
            ids.add(int(part))
    return ids


logger = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 20.0


@dataclass(frozen=True)
class GpuInfo:
    """One GPU the engine may use, as ``nvidia-smi`` lists it."""

    index: str
    name: str
    total_bytes: int
    free_bytes: int


GpuInventory = Callable[[], "list[GpuInfo] | None"]


def visible_gpus() -> list[GpuInfo] | None:
    """The NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES``), in CUDA's order.

    None when ``nvidia-smi`` is missing or fails (no driver, no GPU). Read through
    ``nvidia-smi``, not NVML or torch: the gateway never loads CUDA itself.
    """
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    result = run_probe(
        [
            nvidia_smi,
            "--query-gpu=index,uuid,name,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ],
        _NVIDIA_SMI_TIMEOUT,
    )
    if isinstance(result, str) or result.returncode != 0:
        logger.debug("nvidia-smi failed: %s", result if isinstance(result, str) else result.stderr)
        return None
    gpus: list[tuple[str, GpuInfo]] = []
    for line in result.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 5:
            continue
        name = ", ".join(fields[2:-2])  # a name could hold a comma; the numbers cannot
        with contextlib.suppress(ValueError):
            total, free = (int(float(value)) * 1024 * 1024 for value in fields[-2:])
            gpus.append((fields[1], GpuInfo(fields[0], name, total, free)))
    if not gpus:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [gpu for _, gpu in gpus]
    chosen: list[GpuInfo] = []
    for token in (token.strip() for token in visible.split(",")):
        if token.startswith("MIG-"):
            # MIG slices are not in this listing; do not guess their memory.
            return [gpu for _, gpu in gpus]
        match = [gpu for uuid, gpu in gpus if _names_gpu(token, gpu.index, uuid)]
        if not match:
            break  # CUDA ignores everything from the first entry it cannot match
        chosen.append(match[0])
    return chosen


def visible_gpu_free_bytes() -> list[int] | None:
    """Free memory of each GPU ``visible_gpus`` lists; None without a GPU."""
    gpus = visible_gpus()
    return None if gpus is None else [gpu.free_bytes for gpu in gpus]


def _names_gpu(token: str, index: str, uuid: str) -> bool:
    # CUDA_VISIBLE_DEVICES takes indices, full UUIDs or unique UUID prefixes.
    return token == index or (token.startswith("GPU-") and uuid.startswith(token))
