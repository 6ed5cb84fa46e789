"""What base-model resolution shares: where models are cached, its error, offline mode.

Hugging Face downloads (base models, ``hf://`` adapter sources and GGUF files) go to the
user's Hugging Face hub cache. Before, loragate kept its own copies under
``CACHE_DIR/models`` (base models, GGUF files) and ``CACHE_DIR/adapters/hf`` (adapter
sources); a repository already there is still used from there.
"""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIRNAME = "models"


class BaseModelError(ValueError):
    """The base model cannot be found or read; the message says what to do."""


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    """The user's Hugging Face hub cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``): what vLLM, transformers and ``huggingface-cli download``
    fill, so a model downloaded for any of them is not fetched again."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_cache_holding(repo_id: str, legacy: Path | None, kind: str = "model") -> Path | None:
    """Where to look for ``repo_id``: loragate's own former cache ``legacy`` when a download
    from before the move is there (it keeps serving, offline too), else None: the user's
    Hugging Face hub cache, as huggingface_hub takes ``cache_dir=None``."""
    if legacy is not None and (legacy / f"{kind}s--{repo_id.replace('/', '--')}").is_dir():
        return legacy
    return None
