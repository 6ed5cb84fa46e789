"""Checks that run before the engine starts, so a doomed boot fails in a second with a sentence
saying what to do instead of minutes later with an engine traceback.

This module is their one composition, in the order worth fixing them (``run_preflight``, and
its model-dependent part again for a model resolved later: ``check_resolved_model``); each
kind lives in its own module: the engine's Python and device (``engine``), the parallel layout
(``parallel``), memory (``memory``), the gateway's port and cache directory (``host``), and
what they read of the machine (``machine``). Nothing here imports vLLM or torch: the engine's
Python is asked through subprocesses, the GPU through ``nvidia-smi``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import psutil

from loragate.engine_flags import ParallelLayout
from loragate.plan.preflight.engine import (
    Device,
    check_accelerator,
    check_engine,
    engine_builds,
)
from loragate.plan.preflight.host import check_cache_dir, check_port
from loragate.plan.preflight.machine import GpuInfo, GpuInventory, numa_node_count, visible_gpus
from loragate.plan.preflight.memory import check_memory
from loragate.plan.preflight.parallel import check_parallel, usable_gpus
from loragate.plan.preflight.problem import PreflightError, PreflightProblem

logger = logging.getLogger(__name__)


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
    engine_args: Sequence[str] | None = None,
    model_name: str | None = None,
    lora: tuple[int, int] = (2, 16),
) -> list[PreflightProblem]:
    """Every problem found, in the order worth fixing them; empty when the boot can go ahead.

    ``model_dir`` None (a model not downloaded yet) skips the memory check; ``port`` 0 skips
    the port check. ``parallel`` is how the engine spreads the model; ``gpu_inventory``
    (default: ``nvidia-smi``), ``numa_nodes`` and ``env`` (default: this process's) are what
    the checks read of the machine, injectable for tests. ``engine_args`` are the user's
    engine flags: the memory plan reads ``--dtype``, ``--quantization`` and the memory flags;
    ``model_name`` is what a refusal calls the model, ``lora`` the engine's ``--max-loras`` and
    ``--max-lora-rank`` (their slots take GPU memory).
    """
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, not {dtype_bytes}")
    problems: list[PreflightProblem | None] = []
    engine_problem = check_engine(engine_python)
    problems.append(engine_problem)
    builds = None if engine_problem else engine_builds(engine_python)
    gpus = None if device == "cpu" else (gpu_inventory or visible_gpus)()
    free = None if gpus is None else [gpu.free_bytes for gpu in gpus]
    accelerator_problem, runs_on = check_accelerator(engine_python, device, free, builds)
    problems.append(accelerator_problem)
    problems += _model_checks(
        parallel or ParallelLayout(),
        runs_on,
        gpus or [],
        engine_python=None if engine_problem else engine_python,
        model_dir=model_dir,
        dtype_bytes=dtype_bytes,
        numa_nodes=numa_nodes,
        env=env,
        engine_args=engine_args,
        model_name=model_name,
        lora=lora,
    )
    problems.append(check_port(host, port))
    problems.append(check_cache_dir(cache_dir))
    found = [problem for problem in problems if problem is not None]
    for problem in found:
        logger.debug("preflight %s: %s", problem.check, problem.message)
    return found


def check_resolved_model(
    layout: ParallelLayout,
    *,
    engine_python: str,
    model_dir: Path,
    dtype_bytes: int,
    cpu_build: bool,
    gpu_inventory: GpuInventory | None = None,
    engine_args: Sequence[str] | None = None,
    model_name: str | None = None,
    lora: tuple[int, int] = (2, 16),
) -> None:
    """Raise PreflightError when the model, once resolved, cannot run in ``layout`` here: the
    part of ``run_preflight`` that needs the model, for one that was not on disk when the
    command line's preflight ran (a model id downloaded at start-up, ``create_server()``)."""
    gpus = None if cpu_build else (gpu_inventory or visible_gpus)()
    runs_on: Literal["gpu", "cpu"] | None = "cpu" if cpu_build else ("gpu" if gpus else None)
    problems = _model_checks(
        layout,
        runs_on,
        gpus or [],
        engine_python=engine_python,
        model_dir=model_dir if runs_on == "gpu" else None,
        dtype_bytes=dtype_bytes,
        engine_args=engine_args,
        model_name=model_name,
        lora=lora,
    )
    found = [problem for problem in problems if problem is not None]
    if found:
        raise PreflightError(found)


def _model_checks(
    layout: ParallelLayout,
    runs_on: Literal["gpu", "cpu"] | None,
    gpus: list[GpuInfo],
    *,
    engine_python: str | None,
    model_dir: Path | None,
    dtype_bytes: int,
    numa_nodes: Callable[[], int] | None = None,
    env: Mapping[str, str] | None = None,
    engine_args: Sequence[str] | None = None,
    model_name: str | None = None,
    lora: tuple[int, int] = (2, 16),
) -> list[PreflightProblem | None]:
    """The checks that depend on the model and how it is spread: the layout, then memory
    (on GPUs, ``gateway plan``'s plan of this one engine: the same reason word for word)."""
    problems: list[PreflightProblem | None] = list(
        check_parallel(
            layout,
            runs_on,
            gpus,
            engine_python=engine_python,
            numa_nodes=numa_nodes or numa_node_count,
            env=os.environ if env is None else env,
        )
    )
    usable = usable_gpus(gpus, layout)
    if model_dir is not None and runs_on == "gpu" and len(usable) >= layout.local_workers:
        # Imported here: the GPU plan builds on this package's modules.
        from loragate.plan.gpu.serve_plan import memory_problem, plan_one

        placement = plan_one(
            model_dir,
            gpus,
            layout,
            engine_args=engine_args,
            engine_python=engine_python,
            name=model_name,
            max_loras=lora[0],
            max_lora_rank=lora[1],
        )
        problems.append(memory_problem(placement))
    elif model_dir is not None and runs_on == "cpu":
        available = psutil.virtual_memory().available
        problems.append(
            check_memory(model_dir, dtype_bytes, available, "cpu", engine_args=engine_args)
        )
    return problems
