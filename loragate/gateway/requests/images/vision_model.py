"""Whether the served base model takes images, or videos: a vision model asked without an
image gets a 400 that says how to send one (``chat``), a text model is never asked for one; a
video ``source`` to a model whose config has no video input is a 400 saying so."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from loragate.settings import Settings


def model_takes_images(settings: Settings) -> bool:
    """Whether the served base model is a vision-language model.

    ``settings.vision_model`` decides when set; otherwise the model's ``config.json`` does
    (a local directory, or a Hugging Face id already in the cache). The bundled text demo
    and models whose config cannot be read count as text-only.
    """
    if settings.vision_model is not None:
        return settings.vision_model
    if settings.model is None:
        return False
    key = (settings.model, str(settings.cache_dir))
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict
    if time.monotonic() - _UNKNOWN_SINCE.get(key, -_RECHECK_UNKNOWN_AFTER) < _RECHECK_UNKNOWN_AFTER:
        return False
    config = _read_model_config(settings.model, str(settings.cache_dir.expanduser()))
    if config is None:
        _UNKNOWN_SINCE[key] = time.monotonic()
        return False
    _VERDICTS[key] = verdict = config_takes_images(config)
    return verdict


_VERDICTS: dict[tuple[str, str], bool] = {}
_UNKNOWN_SINCE: dict[tuple[str, str], float] = {}
_RECHECK_UNKNOWN_AFTER = 10.0  # seconds; a model still downloading gets its config.json later


def _read_model_config(model: str, cache_dir: str) -> dict[str, Any] | None:
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        if model.count("/") > 1 or model.startswith(("/", ".", "~")):
            return None
        from huggingface_hub import try_to_load_from_cache

        from loragate.base_model.hub_cache import hub_cache_holding

        legacy = hub_cache_holding(model, Path(cache_dir) / "models")
        found = try_to_load_from_cache(model, "config.json", cache_dir=legacy)
        if not isinstance(found, str):
            return None
        path = Path(found)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def config_takes_images(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` describes a model with an image encoder."""
    if isinstance(config.get("vision_config"), dict):
        return True
    if "image_token_id" in config or "image_token_index" in config:
        return True
    architectures = config.get("architectures") or []
    return any(isinstance(a, str) and ("Vision" in a or "VL" in a) for a in architectures)


def model_takes_video(settings: Settings) -> bool | None:
    """Whether the served base model reads videos, as its ``config.json`` says (None: no
    config to read, e.g. a custom backend or a model still downloading: the engine decides)."""
    if settings.model is None:
        return None
    key = (settings.model, str(settings.cache_dir))
    if key not in _VIDEO_VERDICTS:
        config = _read_model_config(settings.model, str(settings.cache_dir.expanduser()))
        if config is None:
            return None
        _VIDEO_VERDICTS[key] = config_takes_video(config)
    return _VIDEO_VERDICTS[key]


_VIDEO_VERDICTS: dict[tuple[str, str], bool] = {}


def config_takes_video(config: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` describes a model with a video input: vLLM's
    video models (Qwen2-VL to Qwen3-VL and the Cosmos Reason models built on them, LLaVA
    OneVision, ...) name a video token in it."""
    for where in (config, config.get("text_config") or {}):
        if isinstance(where, dict) and any(
            key in where for key in ("video_token_id", "video_token_index", "video_token")
        ):
            return True
    architectures = config.get("architectures") or []
    return any(isinstance(a, str) and "Video" in a for a in architectures)
