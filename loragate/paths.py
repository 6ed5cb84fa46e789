"""Where loragate keeps its files by default (a leaf: imports nothing of loragate)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "loragate"
