"""Where loragate keeps its files by default (a leaf: imports nothing of loragate).

Two kinds of files: the cache (the adapter store, downloaded and converted models, logs:
anything that can be fetched or rebuilt again) and the state (the runtime adapter manifest:
what was added at runtime, lost for good if deleted). Under systemd, ``CacheDirectory=`` and
``StateDirectory=`` hand a service its own directories as ``$CACHE_DIRECTORY`` and
``$STATE_DIRECTORY``; those win over the XDG defaults.
"""

from __future__ import annotations

import os
from pathlib import Path


def _systemd_directory(variable: str) -> Path | None:
    # systemd lists several directories separated by ':' when the unit names several.
    first = os.environ.get(variable, "").split(":")[0]
    return Path(first) if first else None


def default_cache_dir() -> Path:
    systemd = _systemd_directory("CACHE_DIRECTORY")
    if systemd is not None:
        return systemd
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "loragate"


def default_state_dir() -> Path | None:
    """systemd's ``$STATE_DIRECTORY``; else None: the state stays in the cache dir, where every
    loragate before the setting kept it."""
    return _systemd_directory("STATE_DIRECTORY")
