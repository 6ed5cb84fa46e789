"""Whether the engine's parallel layout (tensor, pipeline, data parallel; mp or Ray) can run
here: the CPU build's limits, Ray in the engine's Python, enough GPUs on this node."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

from loragate.engine_flags import ParallelLayout
from loragate.plan.preflight.machine import ENGINE_PYTHON_TIMEOUT, GpuInfo, run_probe
from loragate.plan.preflight.problem import PreflightProblem

_RAY_PROBE = "import importlib.util,sys; sys.exit(importlib.util.find_spec('ray') is None)"


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
    elif (
        runs_on == "gpu"
        and not spans_nodes
        and len(usable_gpus(gpus, layout)) < layout.local_workers
    ):
        problems.append(_mig_slices(layout, gpus))
    return [problem for problem in problems if problem is not None]


def usable_gpus(gpus: list[GpuInfo], layout: ParallelLayout) -> list[GpuInfo]:
    """The GPUs an engine of ``layout`` can spread over: with more than one worker, none of
    the MIG slices (CUDA shows a process one MIG slice at most)."""
    return gpus if layout.local_workers <= 1 else [gpu for gpu in gpus if not gpu.is_mig]


def _mig_slices(layout: ParallelLayout, gpus: list[GpuInfo]) -> PreflightProblem:
    slices = [gpu for gpu in gpus if gpu.is_mig]
    return PreflightProblem(
        "parallel",
        f"{layout.describe()} needs {layout.local_workers} GPUs, and MIG slices cannot be among "
        f"them: CUDA shows a process one MIG slice at most ({len(slices)} of the "
        f"{len(gpus)} GPUs visible are MIG slices, such as {slices[0].note or slices[0].name})."
        " Run the engine on one slice (--tensor-parallel-size 1), or on GPUs not in MIG mode.",
    )


def _check_ray(engine_python: str, layout: ParallelLayout) -> PreflightProblem | None:
    result = run_probe([engine_python, "-c", _RAY_PROBE], ENGINE_PYTHON_TIMEOUT)
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
