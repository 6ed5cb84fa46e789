"""What the engine will serve and how, decided once per start of a model before it boots.

The model (the user's own, a Datature Vi run, or the tiny or SmolLM2 demo when asked for:
never as a fallback) with the adapters it boots with, then what the engine needs beyond the
user's flags: tool calling, its memory on the CPU build or its share and devices on GPUs,
loragate's CPU LoRA ops, the zero adapter's slot, sleep mode, and a check of the parallel
layout. ``plan_engine`` returns them as one ``EnginePlan`` whose ``spec`` is the whole engine
spec (``loragate.plan.engine_spec``): a boot adds only its socket, key and adapters.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.demo.layout import (
    DEMO_ADAPTERS,
    SMOLLM_ADAPTERS,
    demo_adapter_dir,
    demo_base_dir,
    ensure_demo,
    ensure_smollm_demo,
    smollm_engine_args,
)
from loragate.engine_flags import engine_arg_value
from loragate.plan.cpu import (
    RUNTIME_BYTES,
    dtype_bytes,
    flag_value,
    plan_kv_cache,
    plugin_problem,
    user_sized,
    weights_bytes,
)
from loragate.plan.engine_spec import engine_spec
from loragate.plan.gpu.placement import Placement
from loragate.plan.gpu.serve_plan import memory_problem, plan_one
from loragate.plan.preflight import check_resolved_model, run_preflight
from loragate.plan.preflight.host import check_port
from loragate.plan.preflight.machine import visible_gpus
from loragate.plan.preflight.problem import PreflightError
from loragate.plan.tool_parsers import check_tool_parser, tool_call_parser
from loragate.settings import Settings
from loragate.supervisor.command import EngineSpec, is_cpu_build

log = logging.getLogger("loragate.gateway")


@dataclass(frozen=True)
class EnginePlan:
    """What ``plan_engine`` decided for one model's engine."""

    spec: EngineSpec  # what the engine runs; each boot adds its socket, key and adapters
    model_dir: Path
    base_config: dict[str, Any]
    boot_loras: tuple[tuple[str, str], ...]  # (name, source), the --lora flags' and the demo's
    cpu_build: bool = False
    # Base requests through an all-zero adapter in a slot of its own (the CPU build's guard).
    zero_adapter: bool = False
    memory_plan: str | None = None  # what loragate chose for the engine's memory, if it did
    # About what the running engine holds (weights, KV cache, runtime), where loragate can tell:
    # what a catalog counts against its memory budget. None: unknown (counted as nothing).
    memory_bytes: int | None = None
    # On GPUs: where the engine runs and its share of each GPU (``gpu.held_bytes``: what it
    # holds of each, by GPU number); None on the CPU build, or without nvidia-smi.
    gpu: Placement | None = None

    @property
    def cpu_lora_ops(self) -> bool:
        """Whether the engine runs ``loragate.engine_plugin``'s LoRA ops."""
        return bool(self.spec.cpu_lora_ops)


@dataclass(frozen=True)
class _Model:
    """The model chosen to serve, before the engine is planned around it."""

    dir: Path
    config: dict[str, Any]
    boot_loras: list[tuple[str, str]]
    flags: dict[str, str]  # the engine flags it needs (the demo's --dtype), the user's aside
    tool_parser: str | None  # the --tool-call-parser asked for


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
    settings: Settings, cache_dir: Path, gpu: Placement | None = None, *, sleep_mode: bool = False
) -> EnginePlan:
    """The plan for ``settings``; raises ``PreflightError`` for a layout that cannot boot.

    On GPUs the engine boots with the GPU plan's ``--gpu-memory-utilization`` and
    ``CUDA_VISIBLE_DEVICES``: ``gpu``, a catalog's placement of this model among its others
    (``loragate.plan.gpu.serve_plan.plan_settings``), else this model planned alone on the
    visible GPUs; a model the plan refuses is refused here with the plan's reason. ``sleep_mode``
    (a catalog model's ``sleep``) holds on GPU builds only: the CPU build has none."""
    model = await _choose_model(settings, cache_dir)
    parser = await asyncio.to_thread(
        tool_call_parser,
        model.tool_parser,
        model.dir,
        model.config,
        settings.engine_args,
        settings.engine_python,
    )
    cpu_build = await asyncio.to_thread(is_cpu_build, settings.engine_python)
    kv_bytes = memory_plan = memory_bytes = None
    if cpu_build and not user_sized(settings.engine_args, dict(os.environ)):
        memory = plan_kv_cache(model.dir, model.config, settings.engine_args)
        kv_bytes, memory_plan = memory.kv_bytes, memory.describe()
        memory_bytes = memory.weights_bytes + memory.kv_bytes + RUNTIME_BYTES
        log.info("engine memory: %s", memory_plan)
    elif cpu_build:
        given = flag_value(list(settings.engine_args), "--kv-cache-memory-bytes")
        if given is not None and given.isdigit():
            memory_bytes = weights_bytes(model.dir) + int(given) + RUNTIME_BYTES
    layout = settings.parallel
    if settings.engine_command is None and (layout.spread or layout.backend is not None):
        # The command line's preflight could not see a model it had not downloaded yet.
        await asyncio.to_thread(
            check_resolved_model,
            layout,
            engine_python=settings.engine_python,
            model_dir=model.dir,
            dtype_bytes=dtype_bytes(model.config, settings.engine_args),
            cpu_build=cpu_build,
            engine_args=settings.engine_args,
            model_name=settings.served_model_name,
            lora=(settings.max_loras, settings.max_lora_rank),
        )
    cpu_lora_ops = placed = None
    if cpu_build:
        cpu_lora_ops = await asyncio.to_thread(_choose_cpu_lora_ops, settings)
    elif settings.engine_command is None:
        placed = await asyncio.to_thread(_place_on_gpus, settings, model, gpu)
    if placed is not None:
        memory_bytes = sum(placed.held_bytes.values())
        memory_plan = (
            f"GPU plan: {', '.join(f'GPU {d}' for d in placed.devices)} at "
            f"--gpu-memory-utilization {placed.share:g}, max_model_len {placed.max_model_len}"
        )
        log.info("engine memory: %s", memory_plan)
    zero_adapter = settings.base_routing == "zero-adapter" or (
        settings.base_routing == "auto" and cpu_build and not cpu_lora_ops
    )
    if sleep_mode and cpu_build and settings.engine_command is None:
        log.warning(
            "model %s: sleep mode is for GPU builds (vLLM's CPU build has none): "
            "unloading it stops its engine",
            settings.served_model_name,
        )
        sleep_mode = False
    spec = engine_spec(
        settings,
        model.dir,
        model_flags=model.flags,
        tool_call_parser=parser,
        kv_cache_memory_bytes=kv_bytes,
        gpu=placed,
        cpu_lora_ops=cpu_lora_ops,
        zero_adapter=zero_adapter,
        sleep_mode=sleep_mode,
    )
    return EnginePlan(
        spec,
        model.dir,
        model.config,
        tuple(model.boot_loras),
        cpu_build=cpu_build,
        zero_adapter=zero_adapter,
        memory_plan=memory_plan,
        memory_bytes=memory_bytes,
        gpu=placed,
    )


# The run's (or the random demo's) JSON without whitespace, as the Vi SDK compiles it
# (vi/utils/compiler.py compile_bounded_grammar); xgrammar takes it only at engine start, and
# "backend" must be named.
_NO_WHITESPACE = {
    "--structured-outputs-config": '{"backend": "xgrammar", "disable_any_whitespace": true}'
}


async def _choose_model(settings: Settings, cache_dir: Path) -> _Model:
    """The model, its boot adapters, the engine flags it needs and the tool-call parser to
    ask for. Its flags give way to the user's (``loragate.engine_flags``)."""
    require_model(settings)
    tool_parser = settings.tool_call_parser
    boot_loras = [parse_lora_flag(value) for value in settings.lora]
    flags: dict[str, str] = {}
    if settings.run_id is not None:
        model_dir, adapter = await asyncio.to_thread(_vi_run, settings, cache_dir)
        if adapter is not None:
            boot_loras.insert(0, (settings.run_id, str(adapter)))
        flags = dict(_NO_WHITESPACE)
    elif settings.model is None and settings.demo == "smollm2":
        # The real demo is served like a user's own model: a directory and its adapters.
        demo = await asyncio.to_thread(ensure_smollm_demo, None, settings.engine_python)
        model_dir = demo_base_dir(demo)
        boot_loras = [
            (a.name, str(demo_adapter_dir(demo, a.name))) for a in SMOLLM_ADAPTERS
        ] + boot_loras
        # float32 on the CPU build, as built; on a GPU in the dtype a user's model runs.
        cpu_build = await asyncio.to_thread(is_cpu_build, settings.engine_python)
        flags = _as_flags(smollm_engine_args(cpu_build))
    elif settings.model is None:  # the tiny demo (require_model: it was asked for)
        demo = await asyncio.to_thread(ensure_demo, None, settings.engine_python)
        model_dir = demo_base_dir(demo)
        # The demo's template asks for calls in the pythonic form (not Llama 3's JSON).
        tool_parser = settings.tool_call_parser or "pythonic"
        boot_loras = [
            (a.name, str(demo_adapter_dir(demo, a.name))) for a in DEMO_ADAPTERS
        ] + boot_loras
        # Under a JSON schema the random demo model would pad with whitespace forever.
        flags = {"--dtype": "float32", **_NO_WHITESPACE}
    else:
        from loragate.base_model.resolve import resolve_base_model

        model_dir = await asyncio.to_thread(
            resolve_base_model,
            settings.model,
            cache_dir,
            python=settings.engine_python,
            dtype=engine_arg_value(settings.engine_args, "--dtype"),  # a GGUF's, converted
        )
    from loragate.base_model.resolve import read_base_config

    return _Model(model_dir, read_base_config(model_dir), boot_loras, flags, tool_parser)


def _as_flags(args: Sequence[str]) -> dict[str, str]:
    """``("--flag", "value", ...)`` as ``{"--flag": "value"}``."""
    return dict(zip(args[::2], args[1::2], strict=True))


def _place_on_gpus(settings: Settings, model: _Model, gpu: Placement | None) -> Placement | None:
    """The GPU plan's placement of the engine, planned here when ``gpu`` is none or was
    planned before the model was on disk; ``PreflightError`` with the plan's reason when it
    refuses the engine. None without nvidia-smi, or when its need cannot be told: vLLM's
    defaults apply."""
    if gpu is None or gpu.fits is None:  # none given, or one planned before the model was here
        gpus = visible_gpus()
        if not gpus:
            return None
        gpu = plan_one(
            model.dir,
            gpus,
            settings.parallel,
            engine_args=[
                *(arg for pair in model.flags.items() for arg in pair),
                *settings.engine_args,
            ],
            engine_python=settings.engine_python,
            name=settings.served_model_name,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
        )
    if (problem := memory_problem(gpu)) is not None:
        raise PreflightError([problem])
    if not gpu.fits:
        log.info("GPU plan: %s", gpu.reason)
        return None
    for warning in gpu.warnings:  # a share of the user's own that vLLM may still refuse
        log.warning("GPU plan: %s", warning)
    return gpu


def _choose_cpu_lora_ops(settings: Settings) -> bool:
    """Whether the engine runs loragate's CPU LoRA ops: when the settings ask and the engine
    will take them."""
    if not settings.cpu_lora_ops:
        log.info("CPU LoRA ops: vLLM's own (cpu_lora_ops is off)")
        return False
    problem = plugin_problem(settings.engine_python, dict(os.environ))
    if problem is not None:
        log.warning("CPU LoRA ops: vLLM's own, behind loragate's guards (%s)", problem)
        return False
    log.info("CPU LoRA ops: loragate's (index-safe, slot-grouped); base requests go plainly")
    return True


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
