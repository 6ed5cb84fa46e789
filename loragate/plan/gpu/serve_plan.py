"""The plan ``gateway plan`` prints and ``gateway serve`` follows, from the settings: the
engines they ask for (one model, or a catalog's), each planned from its ``config.json`` and
safetensors headers alone, on the GPUs ``nvidia-smi`` lists or on GPUs described by hand.

A model is planned where it is: a local directory as it is; a Hugging Face id from the hub
cache when it was downloaded before, else from its ``config.json`` and safetensors headers
fetched from the hub (a few KiB per file: no weights), kept under ``CACHE_DIR/plan/``. A GGUF
file, a Datature Vi run and the demo are planned once on disk (``fits`` null until then).
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loragate.engine_flags import ParallelLayout, parallel_layout
from loragate.plan.engine_spec import model_settings
from loragate.plan.gpu.need import EngineAsk
from loragate.plan.gpu.placement import GpuPlan, Placement, plan_gpus
from loragate.plan.gpu.vllm_rules import engine_rules
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.problem import PreflightProblem
from loragate.settings import Settings

log = logging.getLogger("loragate.gateway")

_PLAN_DIRNAME = "plan"
_HUB_FILES = ("config.json", "tokenizer_config.json")


def plan_settings(settings: Settings, gpus: Sequence[GpuInfo], *, fetch: bool = True) -> GpuPlan:
    """The plan for what ``settings`` serve on ``gpus``: each engine's GPUs, share and sizes,
    and which engines can be resident together. ``fetch`` lets a Hugging Face id missing from
    the cache be planned from the hub's headers."""
    asks = engine_asks(settings, fetch=fetch)
    budget = int(settings.memory_budget) if settings.memory_budget is not None else None
    return plan_gpus(
        asks,
        gpus,
        engine_rules(settings.engine_python),
        max_loaded=settings.max_loaded_models if settings.models else None,
        budget=budget if settings.models else None,
    )


def plan_host(settings: Settings, available: int | None = None, *, fetch: bool = True) -> GpuPlan:
    """The CPU build's plan, without GPUs: each engine's KV cache as ``gateway serve`` sizes it
    from ``available`` host memory (default: what NUMA node 0 has free), and which engines fit
    in it together, within ``max_loaded_models`` and ``memory_budget``."""
    from loragate.plan.cpu import (
        RUNTIME_BYTES,
        ModelDoesNotFit,
        node_available_bytes,
        plan_kv_cache,
        user_sized,
    )
    from loragate.plan.preflight.model_files import read_json

    room = node_available_bytes() if available is None else available
    budget = int(settings.memory_budget) if settings.memory_budget is not None else room
    placements: list[Placement] = []
    resident: list[str] = []
    held = 0
    for ask in engine_asks(settings, fetch=fetch):
        placement = Placement(ask.name, reason=ask.unknown)
        placements.append(placement)
        if ask.model_dir is None or user_sized(list(ask.engine_args), {}):
            placement.reason = placement.reason or (
                "cannot tell: the engine's memory is sized by its own flags"
            )
            continue
        config = read_json(ask.model_dir / "config.json")
        try:
            kv = plan_kv_cache(ask.model_dir, config, list(ask.engine_args), room)
        except ModelDoesNotFit as exc:
            placement.fits, placement.reason = False, str(exc)
            continue
        placement.fits = True
        placement.weights_bytes, placement.kv_cache_bytes = kv.weights_bytes, kv.kv_bytes
        placement.max_model_len, placement.args = kv.max_model_len, kv.engine_args()
        placement.argv = ["--model", str(ask.model_dir), *placement.args, *ask.engine_args]
        cost = kv.weights_bytes + kv.kv_bytes + RUNTIME_BYTES
        cap = settings.max_loaded_models if settings.models else None
        if (cap is None or len(resident) < cap) and held + cost <= budget:
            placement.resident = True
            resident.append(ask.name)
            held += cost
    return GpuPlan([], placements, resident, engine_rules(settings.engine_python), room)


def engine_asks(settings: Settings, *, fetch: bool = True) -> list[EngineAsk]:
    """One ``EngineAsk`` per engine loragate would run for ``settings``: none for an upstream
    server or an engine command of the user's own."""
    if settings.upstream_url is not None or settings.engine_command is not None:
        return []
    cache_dir = settings.cache_dir.expanduser()
    if not settings.models:
        return [
            _ask(
                settings,
                settings.served_model_name,
                settings.model,
                list(settings.engine_args),
                cache_dir,
                fetch=fetch,
            )
        ]
    asks = []
    for model_id, entry in settings.models.items():
        args = model_settings(settings, model_id, entry).engine_args
        ask = _ask(settings, model_id, entry.model, args, cache_dir, fetch=fetch)
        devices = tuple(entry.devices) if entry.devices is not None else None
        asks.append(
            replace(
                ask,
                devices=devices,
                keep=entry.keep,
                preload=entry.preload,
                flags_at=f"in models.{model_id}.engine_args, or after -- for every model",
            )
        )
    return asks


def _ask(
    settings: Settings,
    name: str,
    model: str | None,
    engine_args: list[str],
    cache_dir: Path,
    *,
    fetch: bool,
) -> EngineAsk:
    try:
        layout = parallel_layout(engine_args, settings.parallel_options())
    except ValueError:
        layout = ParallelLayout()
    where: Path | str
    if model is None:
        where = (
            "cannot tell: a Datature Vi run is planned once downloaded (gateway serve fetches it)"
            if settings.run_id is not None
            else "cannot tell: the demo is planned once built (gateway demo builds it)"
        )
    else:
        where = planning_dir(model, cache_dir, fetch=fetch)
    return EngineAsk(
        name=name,
        model_dir=where if isinstance(where, Path) else None,
        engine_args=tuple(engine_args),
        layout=layout,
        lora_slots=settings.max_loras,
        lora_rank=settings.max_lora_rank,
        unknown=where if isinstance(where, str) else None,
    )


def planning_dir(model: str, cache_dir: Path, *, fetch: bool = True) -> Path | str:
    """A directory holding ``model``'s ``config.json`` and safetensors headers, or why there
    is none (a sentence starting ``cannot tell``)."""
    from loragate.model_names import is_gguf_source

    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if is_gguf_source(model):
        return (
            f"cannot tell: {model} is a GGUF file, planned once converted: gateway pull "
            f"{model} converts it and names the directory, which gateway plan takes"
        )
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        return f"cannot tell: {model} is no directory"
    cached = _hub_snapshot(model, cache_dir)
    if cached is not None:
        return cached
    shapes = cache_dir / _PLAN_DIRNAME / model.replace("/", "--")
    if (shapes / "config.json").is_file():
        return shapes
    from loragate.base_model.hub_cache import offline

    if not fetch or offline():
        return (
            f"cannot tell: {model} is not in the Hugging Face cache (gateway pull {model}, or "
            "plan with the hub reachable: only its config.json and safetensors headers are read)"
        )
    try:
        _fetch_shapes(model, shapes)
    except Exception as exc:  # the hub raises many kinds: auth, not found, network
        log.debug("plan: no headers for %s: %s", model, exc)
        said = str(exc).split(". ")[0].splitlines()[0] if str(exc) else type(exc).__name__
        return (
            f"cannot tell: the hub gave no config.json and safetensors headers for {model} "
            f"({said}); gateway pull {model} and plan again"
        )
    return shapes


def _hub_snapshot(model: str, cache_dir: Path) -> Path | None:
    """The model's snapshot in the Hugging Face cache, when it was downloaded whole."""
    try:
        from huggingface_hub import snapshot_download

        from loragate.base_model.hub_cache import MODELS_DIRNAME, hub_cache_holding

        found = snapshot_download(
            model,
            cache_dir=hub_cache_holding(model, cache_dir / MODELS_DIRNAME),
            local_files_only=True,
        )
    except Exception:  # not there (LocalEntryNotFoundError), or not a valid id
        return None
    path = Path(found)
    return path if (path / "config.json").is_file() else None


def _fetch_shapes(model: str, target: Path) -> None:
    """``config.json`` (and the tokenizer's config) and every safetensors file's header, from
    the hub (HTTP range reads of the headers: no weights), into ``target``: each header over
    an empty body, all ``model_files`` reads. The hub cache is not touched, so a later
    download is not mistaken for done."""
    from huggingface_hub import HfApi, hf_hub_download

    from loragate.fetching.hub import check_hub_endpoint, hf_token

    check_hub_endpoint()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    token = hf_token()
    try:
        for name in _HUB_FILES:
            try:
                hf_hub_download(model, name, local_dir=partial, token=token)
            except Exception:
                if name == "config.json":
                    raise
        metadata = HfApi().get_safetensors_metadata(model, token=token)
        for filename, info in metadata.files_metadata.items():
            tensors = {
                name: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "data_offsets": list(t.data_offsets),
                }
                for name, t in info.tensors.items()
            }
            write_header(partial / Path(filename).name, tensors)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.replace(target)


def write_header(path: Path, tensors: dict[str, Any]) -> None:
    """A safetensors file holding ``tensors``' header and no data: enough to plan from."""
    raw = json.dumps(tensors).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def memory_problem(placement: Placement) -> PreflightProblem | None:
    """The preflight's memory check of one planned engine: ``gateway plan``'s reason when the
    plan refuses it, nothing when it fits or its need cannot be told."""
    if placement.fits is False and placement.reason:
        return PreflightProblem("memory", placement.reason)
    return None


def plan_one(
    model_dir: Path,
    gpus: Sequence[GpuInfo],
    layout: ParallelLayout,
    *,
    engine_args: Sequence[str] | None = None,
    engine_python: str | None = None,
    name: str | None = None,
    max_loras: int = 2,
    max_lora_rank: int = 16,
) -> Placement:
    """One engine planned alone on ``gpus`` (a single model's ``gateway serve``)."""
    ask = EngineAsk(
        name=name or model_dir.name,
        model_dir=model_dir,
        engine_args=tuple(engine_args or ()),
        layout=layout,
        lora_slots=max_loras,
        lora_rank=max_lora_rank,
    )
    return plan_gpus([ask], gpus, engine_rules(engine_python)).engines[0]
