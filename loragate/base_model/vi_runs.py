"""Datature Vi training runs: find or download one, read its layout, and serve it as Vi does.

A downloaded run looks like (the Vi SDK's own layout, ``vi/api/resources/models/downloader.py``
``_find_model_paths``; its cache is ``~/.datature/vi/models/<run_id>/``, ``vi/consts.py``)::

    <dest>/<run_id>/model_full/          # the model; run.json describes the run
    <dest>/<run_id>/model_adapter/       # a PEFT LoRA adapter, when the run trained one

``vi_run_preset`` turns ``run.json`` into the run's preset the way the SDK's loaders read it
(``vi/inference/loaders/base_loader.py``), so the run is asked as it was trained and as the Vi
server asks it; ``served_vi_run`` hands the preset to the adapter version (or, for a full
fine-tune, to the base model) as the ``loragate.json`` beside its files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from loragate.base_model.vi_tasks import VI_TASKS
from loragate.fetching.json_file import read_json_object

VI_FULL_DIRNAME = "model_full"
VI_ADAPTER_DIRNAME = "model_adapter"
VI_RUN_INFO = "run.json"
SECRET_KEY_ENV = "DATATURE_VI_SECRET_KEY"
ORGANIZATION_ENV = "DATATURE_VI_ORGANIZATION_ID"
VI_EXTRA_HINT = "pip install 'loragate[vi]' (the vi-sdk package)"
# Where the Vi SDK keeps the runs it downloaded (``vi/consts.py``: ``DEFAULT_MODEL_DIR``).
VI_SDK_MODELS_DIR = Path("~/.datature/vi/models")
# Beside the served files: the run's preset, read by the adapter pipeline and the base model's
# wiring (``loragate.adapters.intake.pipeline.SIDECAR_FILENAME``).
PRESET_SIDECAR = "loragate.json"
# The Vi SDK's generation config when run.json has none, or leaves a field out
# (``vi/inference/config/base_config.py``: ``ViGenerationConfig``, the base loader's
# ``_generation_config_class``), under the names vLLM takes.
_VI_GENERATION_DEFAULTS = {
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,
    "max_tokens": 1024,
    "seed": 0,
}
_EVALUATION_NAMES = {
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "seed": "seed",
}
_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ViRunError(ValueError):
    """A Vi run cannot be downloaded or read; the message says what to do."""


def is_vi_run(path: Path) -> bool:
    """True if ``path`` looks like a downloaded Vi run directory."""
    return (path / VI_ADAPTER_DIRNAME).is_dir() or (path / VI_FULL_DIRNAME / VI_RUN_INFO).is_file()


def vi_run_layout(run_dir: Path) -> tuple[Path, Path | None, dict[str, Any]]:
    """``(model_full dir, model_adapter dir or None, run.json contents)`` of a downloaded run."""
    full_dir = run_dir / VI_FULL_DIRNAME
    adapter_dir = run_dir / VI_ADAPTER_DIRNAME
    info_path = full_dir / VI_RUN_INFO
    if not full_dir.is_dir():
        raise ViRunError(
            f"{run_dir} is not a Datature Vi run: it has no {VI_FULL_DIRNAME}/ directory; "
            "download the run again"
        )
    if not info_path.is_file():
        raise ViRunError(
            f"{run_dir} has no {VI_FULL_DIRNAME}/{VI_RUN_INFO}; download the run again"
        )
    info = read_json_object(info_path, ViRunError, "; download the run again")
    return full_dir, (adapter_dir if adapter_dir.is_dir() else None), info


def _blocks(info: dict[str, Any]) -> list[dict[str, Any]]:
    """The flow's blocks (``run.json``'s ``spec.flow.blocks``, the SDK's ``FlowSpec``)."""
    spec = info.get("spec")
    flow = spec.get("flow") if isinstance(spec, dict) else None
    blocks = flow.get("blocks") if isinstance(flow, dict) else None
    if not isinstance(blocks, list):
        return []
    return [b for b in blocks if isinstance(b, dict) and isinstance(b.get("settings"), dict)]


def _block(blocks: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The settings of the first block whose type names ``kind``, as the SDK picks it
    (``next(block for block in flow_spec.blocks if kind in block.block)``)."""
    for block in blocks:
        if kind in str(block.get("block", "")):
            settings: dict[str, Any] = block["settings"]
            return settings
    return None


def vi_task_type(info: dict[str, Any]) -> str:
    """The run's task type: the dataset block's ``projectKind`` (``base_loader.py``
    ``_load_metadata_from_run_json``); ``generic`` without one, as for a run.json-less model."""
    dataset = _block(_blocks(info), "dataset")
    task = dataset.get("projectKind") if dataset is not None else None
    if task is None:
        return "generic"
    if task not in VI_TASKS:  # the SDK's predictor fails the same way: TaskType(task)
        raise ViRunError(
            f"run.json's task type (projectKind) {task!r} is none the Vi SDK knows "
            f"({', '.join(VI_TASKS)}); upgrade loragate"
        )
    return str(task)


def vi_run_preset(info: dict[str, Any]) -> dict[str, Any]:
    """The preset ``run.json`` (``info``) stands for, as the Vi SDK reads and serves it.

    - system prompt: the ``system-prompt`` block's ``systemPrompt``, else the task's default
      (``base_loader.py`` ``_load_metadata_from_run_json``, ``_get_default_system_prompt``);
      a request's own system message wins (``default``);
    - user prompt, for a request with only a ``source``: the task's
      (``vi/inference/predictors/hf.py``: ``TASK_TYPE_TO_USER_PROMPT_MAP``);
    - response format: the task's schema, which the SDK enforces by constrained decoding
      (``hf.py``: ``TASK_TYPE_TO_ASSISTANT_MAP``, ``compile_bounded_grammar``);
    - sampling defaults: the ``model`` block's ``evaluation`` over ``ViGenerationConfig``'s
      defaults (``_load_generation_config_from_run_json``), greedy (temperature 0) because the
      SDK's predictor always generates with ``do_sample = False``
      (``hf.py`` ``_prepare_generation_config``); its ``stop_strings`` as stop strings.
    """
    blocks = _blocks(info)
    task = VI_TASKS[vi_task_type(info)]
    preset: dict[str, Any] = {}
    system = _block(blocks, "system-prompt")
    system_prompt = system.get("systemPrompt") if system is not None else task.system_prompt
    if isinstance(system_prompt, str) and system_prompt:
        preset["system_prompt"] = system_prompt
    if task.user_prompt is not None:
        preset["user_prompt"] = task.user_prompt
    if task.schema is not None:
        preset["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": task.schema_name, "schema": task.schema, "strict": True},
        }
    model = _block(blocks, "model")
    evaluation = model.get("evaluation") if model is not None else None
    evaluation = evaluation if isinstance(evaluation, dict) else {}
    defaults: dict[str, Any] = {"temperature": 0.0, **_VI_GENERATION_DEFAULTS}
    for vi_name, name in _EVALUATION_NAMES.items():
        if evaluation.get(vi_name) is not None:
            defaults[name] = evaluation[vi_name]
    if defaults["seed"] == -1:  # the SDK's "no seed"
        del defaults["seed"]
    preset["defaults"] = defaults
    stop = evaluation.get("stop_strings")
    if isinstance(stop, list) and stop:
        preset["stop"] = [s for s in stop if isinstance(s, str) and s]
    return preset


def sdk_cached_run(run_id: str, models_dir: Path = VI_SDK_MODELS_DIR) -> Path | None:
    """The run's directory in the Vi SDK's cache when the SDK would use it without a download
    (``vi/inference/vi_model.py``, ``ViModel.__init__``: ``model_full/`` there with all its
    safetensors, ``vi/utils/safetensors.py`` ``safetensors_complete``); None otherwise."""
    run_dir = models_dir.expanduser() / run_id
    full = run_dir / VI_FULL_DIRNAME
    if not full.is_dir() or not (full / VI_RUN_INFO).is_file():
        return None
    index = full / "model.safetensors.index.json"
    if not index.exists():
        return run_dir if (full / "model.safetensors").is_file() else None
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (ValueError, OSError, AttributeError):
        return None
    return run_dir if shards and all((full / s).is_file() for s in shards) else None


def checked_checkpoint(checkpoint: str) -> str:
    """``checkpoint`` if it is a plain name (it becomes a directory name); else ``ViRunError``."""
    if not _CHECKPOINT_NAME.fullmatch(checkpoint):
        raise ViRunError(
            f"Vi checkpoint {checkpoint!r} must be a plain name such as epoch_10 "
            "(letters, digits, '.', '_', '-')"
        )
    return checkpoint


def served_vi_run(run_dir: Path, prepared: Path) -> tuple[Path, Path | None]:
    """``(base model dir, adapter dir or None)`` to serve the run in ``run_dir``, each carrying
    the run's preset as its ``loragate.json``: the adapter's (copied into ``prepared``: it is
    small), else, for a full fine-tune, the base model's (``prepared`` links to its files). The
    run's own files are never written; a ``loragate.json`` the run already has wins."""
    full, adapter, info = vi_run_layout(run_dir)
    preset = vi_run_preset(info)
    shutil.rmtree(prepared, ignore_errors=True)
    prepared.mkdir(parents=True)
    sidecar = json.dumps({"preset": preset}, indent=2)
    if adapter is not None:
        served_adapter = prepared / VI_ADAPTER_DIRNAME
        shutil.copytree(adapter, served_adapter)
        if not (served_adapter / PRESET_SIDECAR).exists():
            (served_adapter / PRESET_SIDECAR).write_text(sidecar)
        return full, served_adapter
    if (full / PRESET_SIDECAR).exists():
        return full, None
    served_full = prepared / VI_FULL_DIRNAME
    served_full.mkdir()
    for entry in full.iterdir():
        (served_full / entry.name).symlink_to(entry.resolve())
    (served_full / PRESET_SIDECAR).write_text(sidecar)
    return served_full, None


def download_vi_run(
    run_id: str,
    secret_key: str | None,
    organization_id: str | None,
    dest: Path,
    *,
    checkpoint: str | None = None,
    progress: bool = True,
) -> Path:
    """Download Vi training run ``run_id`` into ``dest/<run_id>/`` and return that directory.

    Credentials fall back to ``DATATURE_VI_SECRET_KEY`` / ``DATATURE_VI_ORGANIZATION_ID``.
    Needs the ``vi-sdk`` package (the ``loragate[vi]`` extra).
    """
    try:
        import vi
    except ImportError as exc:
        raise ViRunError(
            f"downloading a Datature Vi run needs the vi-sdk package: {VI_EXTRA_HINT}"
        ) from exc
    secret_key = secret_key or os.environ.get(SECRET_KEY_ENV)
    organization_id = organization_id or os.environ.get(ORGANIZATION_ENV)
    if not secret_key or not organization_id:
        raise ViRunError(
            "downloading a Datature Vi run needs credentials: pass --secret-key and "
            f"--organization-id, or set {SECRET_KEY_ENV} and {ORGANIZATION_ENV}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    try:
        client = vi.Client(secret_key=secret_key, organization_id=organization_id)
        result = client.get_model(
            run_id=run_id, ckpt=checkpoint, save_path=dest, show_progress=progress
        )
    except Exception as exc:  # the SDK raises its own ViError family and httpx errors
        raise ViRunError(f"Datature Vi could not download run {run_id!r}: {exc}") from exc
    if result is None:
        raise ViRunError(f"the download of Vi run {run_id!r} was cancelled")
    run_dir = Path(result.model_path).parent
    vi_run_layout(run_dir)
    return run_dir
