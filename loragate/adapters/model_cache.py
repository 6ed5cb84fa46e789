"""What base-model resolution shares: where models are cached, its error, offline mode."""

from __future__ import annotations

import os

MODELS_DIRNAME = "models"


class BaseModelError(ValueError):
    """The base model cannot be found or read; the message says what to do."""


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
