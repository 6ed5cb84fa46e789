"""What one model's engine runs: the settings it is planned from, and the frozen spec that the
plan's choices make of them.

``plan_engine`` (``loragate.plan.engine_plan``) makes the choices (the model, tool calling, the
engine's memory and devices, the CPU LoRA ops, the zero adapter's slot, sleep mode) and hands
them to ``engine_spec``, the one place where settings and choices become an ``EngineSpec``;
``loragate.supervisor.command`` spells that as the engine's argv and environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from loragate.plan.gpu.placement import Placement
from loragate.settings import Settings
from loragate.settings.catalog import CatalogModel
from loragate.supervisor.command import EngineSpec


def model_settings(settings: Settings, model_id: str, entry: CatalogModel) -> Settings:
    """The settings one catalog model runs with: the gateway's, with the entry's model,
    adapters and engine flags (after the gateway's own), under a cache and state directory
    of its own."""
    cache_dir = settings.cache_dir.expanduser().resolve() / "models" / model_id
    state_dir = (settings.state_dir or settings.cache_dir).expanduser().resolve()
    return settings.model_copy(
        update={
            "models": {},
            "model": entry.model,
            "model_name": model_id,
            "lora": list(entry.lora),
            "engine_args": [*settings.engine_args, *entry.engine_args],
            "cache_dir": cache_dir,
            "state_dir": state_dir / "models" / model_id,
        }
    )


def engine_spec(
    settings: Settings,
    model_dir: Path,
    *,
    model_flags: Mapping[str, str] | None = None,
    tool_call_parser: str | None = None,
    kv_cache_memory_bytes: int | None = None,
    gpu: Placement | None = None,
    cpu_lora_ops: bool | None = None,
    zero_adapter: bool = False,
    sleep_mode: bool = False,
) -> EngineSpec:
    """The engine ``settings`` run on ``model_dir`` with the plan's choices: ``gpu`` a placement
    that fits (its share unless the user gave theirs, its devices), ``cpu_lora_ops`` None off
    the CPU build. The user's engine arguments come last, unchanged."""
    # The plan's share, unless the user gave theirs (the plan then adds none).
    share = gpu.share if gpu is not None and "--gpu-memory-utilization" in gpu.args else None
    return EngineSpec(
        model=str(model_dir),
        served_name=settings.served_model_name,
        # One more slot for the zero adapter, so base requests batch with N adapters.
        max_loras=settings.max_loras + (1 if zero_adapter else 0),
        max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        data_parallel_size=settings.data_parallel_size,
        distributed_executor_backend=settings.distributed_executor_backend,
        boot_mode=settings.engine_boot_mode,
        model_flags=model_flags or {},
        tool_call_parser=tool_call_parser,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        gpu_memory_utilization=share,
        visible_devices=gpu.env.get("CUDA_VISIBLE_DEVICES") if gpu is not None else None,
        cpu_lora_ops=cpu_lora_ops,
        max_media_bytes=settings.max_image_bytes,
        sleep_mode=sleep_mode,
        extra_args=settings.engine_args,
        python=settings.engine_python,
        command=settings.engine_command,
        log_to_stderr=settings.engine_log_to_stderr,
        log_max_bytes=settings.engine_log_max_bytes,
        otlp_traces_endpoint=settings.otlp_traces_endpoint,
    )
