"""What the engine will serve and how, decided once per gateway start before it boots.

The model (the user's own, a Datature Vi run, or the tiny or SmolLM2 demo when asked for:
never as a fallback) with the adapters it boots with, then what the engine needs beyond the user's flags: tool calling,
its memory on the CPU build, loragate's CPU LoRA ops, and a check of the parallel layout.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loragate.demo.layout import (
    DEMO_ADAPTERS,
    SMOLLM_ADAPTERS,
    SMOLLM_ENGINE_ARGS,
    demo_adapter_dir,
    demo_base_dir,
    ensure_demo,
    ensure_smollm_demo,
)
from loragate.plan.cpu import (
    RUNTIME_BYTES,
    SWITCH,
    dtype_bytes,
    flag_value,
    plan_kv_cache,
    plugin_problem,
    user_sized,
    weights_bytes,
)
from loragate.plan.gpu.placement import Placement
from loragate.plan.gpu.serve_plan import plan_one
from loragate.plan.preflight import check_resolved_model, run_preflight
from loragate.plan.preflight.host import check_port
from loragate.plan.preflight.machine import visible_gpus
from loragate.plan.preflight.problem import PreflightError, PreflightProblem
from loragate.plan.tool_parsers import check_tool_parser, tool_engine_args
from loragate.settings import Settings
from loragate.supervisor.command import is_cpu_build

log = logging.getLogger("loragate.gateway")


@dataclass
class EnginePlan:
    model_dir: Path
    base_config: dict[str, Any]
    boot_loras: list[tuple[str, str]]  # (name, source), the --lora flags' and the demo's
    extra_args: list[str]  # engine flags loragate adds (before the user's own)
    env: dict[str, str] = field(default_factory=dict)
    cpu_build: bool = False
    memory_plan: str | None = None  # what loragate chose for the engine's memory, if it did
    cpu_lora_ops: bool = False  # whether the engine runs loragate.engine_plugin's LoRA ops
    # About what the running engine holds (weights, KV cache, runtime), where loragate can tell:
    # what a catalog counts against its memory budget. None: unknown (counted as nothing).
    memory_bytes: int | None = None
    # On GPUs: where the engine runs and its share of each GPU (``gpu.held_bytes``: what it
    # holds of each, by GPU number); None on the CPU build, or without nvidia-smi.
    gpu: Placement | None = None


class NoModelError(ValueError):
    """Nothing to serve: no model, no upstream, no Vi run and no demo asked for. The demo is
    never a fallback, so a unit or pod whose settings went missing fails instead of building
    and training the demo on a production machine."""


def names_a_model(settings: Settings) -> bool:
    """Whether ``settings`` say what to serve, the demo aside."""
    return bool(settings.models) or any(
        value is not None for value in (settings.model, settings.upstream_url, settings.run_id)
    )


def require_model(settings: Settings) -> None:
    """Raises ``NoModelError`` unless ``settings`` name a model or a demo (``create_app``'s
    check for an embedded gateway; ``gateway serve`` says it in its own words)."""
    if not names_a_model(settings) and settings.demo is None:
        raise NoModelError(
            "no model to serve: give model= (a directory, ORG/NAME or FILE.gguf), models= (a "
            "catalog), upstream_url= or a backend, or demo='smollm2' (or 'tiny') for the "
            "bundled demo"
        )


def parse_lora_flag(value: str) -> tuple[str, str]:
    name, sep, source = value.partition("=")
    if not sep or not name or not source:
        raise ValueError(f"--lora expects NAME=SOURCE, got {value!r}")
    return name.strip(), source.strip()


def check_before_start(settings: Settings) -> None:
    """What ``gateway serve`` checks before anything starts, so a doomed start fails in a second:
    the tool-call parser (``ToolParserError``, a usage error), then the preflight, or only the
    port when loragate runs no engine itself (``PreflightError`` listing every problem). A model
    named by id is not on disk yet: ``plan_engine`` checks it once resolved."""
    if settings.upstream_url is None and settings.tool_call_parser not in (None, "none"):
        check_tool_parser(settings.tool_call_parser, settings.engine_python, settings.engine_args)
    if settings.engine_command is not None or settings.upstream_url is not None:
        problem = check_port(settings.host, settings.port)
        problems = [] if problem is None else [problem]
    else:
        local_model = settings.model and Path(settings.model)
        problems = run_preflight(
            engine_python=settings.engine_python,
            model_dir=local_model if local_model and local_model.is_dir() else None,
            dtype_bytes=2,
            host=settings.host,
            port=settings.port,
            cache_dir=settings.cache_dir.expanduser(),
            parallel=settings.parallel,
            engine_args=settings.engine_args,
            model_name=settings.served_model_name,
            lora=(settings.max_loras, settings.max_lora_rank),
        )
    if problems:
        raise PreflightError(problems)


async def plan_engine(
    settings: Settings, cache_dir: Path, gpu: Placement | None = None
) -> EnginePlan:
    """The plan for ``settings``; raises ``PreflightError`` for a layout that cannot boot.

    On GPUs the engine boots with the GPU plan's ``--gpu-memory-utilization`` and
    ``CUDA_VISIBLE_DEVICES``: ``gpu``, a catalog's placement of this model among its others
    (``loragate.plan.gpu.serve_plan.plan_settings``), else this model planned alone on the
    visible GPUs; a model the plan refuses is refused here with the plan's reason."""
    plan, tool_parser = await _choose_model(settings, cache_dir)
    plan.extra_args += await asyncio.to_thread(
        tool_engine_args,
        tool_parser,
        plan.model_dir,
        plan.base_config,
        settings.engine_args,
        settings.engine_python,
    )
    plan.cpu_build = await asyncio.to_thread(is_cpu_build, settings.engine_python)
    if plan.cpu_build and not user_sized(settings.engine_args, dict(os.environ)):
        memory = plan_kv_cache(plan.model_dir, plan.base_config, settings.engine_args)
        plan.extra_args += memory.engine_args()
        plan.memory_plan = memory.describe()
        plan.memory_bytes = memory.weights_bytes + memory.kv_bytes + RUNTIME_BYTES
        log.info("engine memory: %s", plan.memory_plan)
    elif plan.cpu_build:
        given = flag_value(list(settings.engine_args), "--kv-cache-memory-bytes")
        if given is not None and given.isdigit():
            plan.memory_bytes = weights_bytes(plan.model_dir) + int(given) + RUNTIME_BYTES
    layout = settings.parallel
    if settings.engine_command is None and (layout.spread or layout.backend is not None):
        # The command line's preflight could not see a model it had not downloaded yet.
        await asyncio.to_thread(
            check_resolved_model,
            layout,
            engine_python=settings.engine_python,
            model_dir=plan.model_dir,
            dtype_bytes=dtype_bytes(plan.base_config, settings.engine_args),
            cpu_build=plan.cpu_build,
            engine_args=settings.engine_args,
            model_name=settings.served_model_name,
            lora=(settings.max_loras, settings.max_lora_rank),
        )
    if plan.cpu_build:
        await asyncio.to_thread(_choose_cpu_lora_ops, settings, plan)
    elif settings.engine_command is None:
        await asyncio.to_thread(_place_on_gpus, settings, plan, gpu)
    return plan


async def _choose_model(settings: Settings, cache_dir: Path) -> tuple[EnginePlan, str | None]:
    """The model and its boot adapters; with the tool-call parser to ask for."""
    require_model(settings)
    tool_parser = settings.tool_call_parser
    boot_loras = [parse_lora_flag(value) for value in settings.lora]
    extra_args: list[str] = []
    if settings.run_id is not None:
        model_dir, adapter = await asyncio.to_thread(_vi_run, settings, cache_dir)
        if adapter is not None:
            boot_loras.insert(0, (settings.run_id, str(adapter)))
        if not any(arg.startswith("--structured-outputs-config") for arg in settings.engine_args):
            # The run's schema without whitespace, as the Vi SDK compiles it
            # (vi/utils/compiler.py compile_bounded_grammar); xgrammar takes it only at start.
            extra_args = [
                "--structured-outputs-config",
                '{"backend": "xgrammar", "disable_any_whitespace": true}',
            ]
    elif settings.model is None and settings.demo == "smollm2":
        # The real demo is served like a user's own model: a directory and its adapters.
        demo = await asyncio.to_thread(ensure_smollm_demo, None, settings.engine_python)
        model_dir = demo_base_dir(demo)
        boot_loras = [
            (a.name, str(demo_adapter_dir(demo, a.name))) for a in SMOLLM_ADAPTERS
        ] + boot_loras
        if not any(arg.startswith("--dtype") for arg in settings.engine_args):
            extra_args = list(SMOLLM_ENGINE_ARGS)
    elif settings.model is None:  # the tiny demo (require_model: it was asked for)
        demo = await asyncio.to_thread(ensure_demo, None, settings.engine_python)
        model_dir = demo_base_dir(demo)
        # The demo's template asks for calls in the pythonic form (not Llama 3's JSON).
        tool_parser = settings.tool_call_parser or "pythonic"
        boot_loras = [
            (a.name, str(demo_adapter_dir(demo, a.name))) for a in DEMO_ADAPTERS
        ] + boot_loras
        if not any(arg.startswith("--dtype") for arg in settings.engine_args):
            extra_args = ["--dtype", "float32"]
        if not any(arg.startswith("--structured-outputs-config") for arg in settings.engine_args):
            # Under a JSON schema the random demo model would pad with whitespace forever;
            # xgrammar takes this only at engine start (and "backend" must be named).
            extra_args += [
                "--structured-outputs-config",
                '{"backend": "xgrammar", "disable_any_whitespace": true}',
            ]
    else:
        from loragate.base_model.resolve import resolve_base_model
        from loragate.engine_flags import engine_arg_value

        model_dir = await asyncio.to_thread(
            resolve_base_model,
            settings.model,
            cache_dir,
            python=settings.engine_python,
            dtype=engine_arg_value(settings.engine_args, "--dtype"),  # a GGUF's, converted
        )
    from loragate.base_model.resolve import read_base_config

    base_config = read_base_config(model_dir)
    return EnginePlan(model_dir, base_config, boot_loras, extra_args), tool_parser


def _place_on_gpus(settings: Settings, plan: EnginePlan, gpu: Placement | None) -> None:
    """Add the GPU plan's share and devices to the engine's flags and environment (the user's
    own --gpu-memory-utilization stays theirs); ``PreflightError`` with the plan's reason when
    it refuses the engine. Without nvidia-smi nothing is added: vLLM's defaults apply."""
    if gpu is None or gpu.fits is None:  # none given, or one planned before the model was here
        gpus = visible_gpus()
        if not gpus:
            return
        gpu = plan_one(
            plan.model_dir,
            gpus,
            settings.parallel,
            engine_args=[*plan.extra_args, *settings.engine_args],
            engine_python=settings.engine_python,
            name=settings.served_model_name,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
        )
    if gpu.fits is False and gpu.reason:
        raise PreflightError([PreflightProblem("memory", gpu.reason)])
    if not gpu.fits:
        log.info("GPU plan: %s", gpu.reason)  # its need cannot be told: vLLM's defaults
        return
    plan.gpu = gpu
    plan.extra_args += gpu.args
    plan.env.update(gpu.env)
    plan.memory_bytes = sum(gpu.held_bytes.values())
    plan.memory_plan = (
        f"GPU plan: {', '.join(f'GPU {d}' for d in gpu.devices)} at "
        f"--gpu-memory-utilization {gpu.share:g}, max_model_len {gpu.max_model_len}"
    )
    log.info("engine memory: %s", plan.memory_plan)


def _choose_cpu_lora_ops(settings: Settings, plan: EnginePlan) -> None:
    """Switch the engine plugin on when the settings ask and the engine will take it."""
    plan.env[SWITCH] = "0"
    if not settings.cpu_lora_ops:
        log.info("CPU LoRA ops: vLLM's own (cpu_lora_ops is off)")
        return
    problem = plugin_problem(settings.engine_python, dict(os.environ))
    if problem is not None:
        log.warning("CPU LoRA ops: vLLM's own, behind loragate's guards (%s)", problem)
        return
    plan.env[SWITCH] = "1"
    plan.cpu_lora_ops = True
    log.info("CPU LoRA ops: loragate's (index-safe, slot-grouped); base requests go plainly")


def _vi_run(settings: Settings, cache_dir: Path) -> tuple[Path, Path | None]:
    """A Datature Vi run's base model and adapter, each with the run's preset beside it: the
    run as downloaded before into the cache dir, else as the Vi SDK keeps it in its own cache
    (used offline, no credentials), else downloaded now. A chosen checkpoint has its own
    directory and skips the SDK's cache, which does not record which checkpoint it holds."""
    from loragate.base_model.vi_runs import (
        checked_checkpoint,
        download_vi_run,
        sdk_cached_run,
        served_vi_run,
    )

    assert settings.run_id is not None
    runs = cache_dir / "vi-runs"
    checkpoint = settings.checkpoint
    if checkpoint is not None:
        runs = runs / "checkpoints" / checked_checkpoint(checkpoint)
    run_dir = runs / settings.run_id
    if not run_dir.is_dir():
        cached = sdk_cached_run(settings.run_id) if checkpoint is None else None
        if cached is not None:
            log.info("Vi run %s: from the Vi SDK's cache, %s", settings.run_id, cached)
            run_dir = cached
        else:
            run_dir = download_vi_run(
                settings.run_id,
                settings.secret_key,
                settings.organization_id,
                runs,
                checkpoint=checkpoint,
            )
    served = cache_dir / "vi-runs" / "served" / f"{settings.run_id}@{checkpoint or 'latest'}"
    return served_vi_run(run_dir, served)
