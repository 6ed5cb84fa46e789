"""Whether the cache directory (adapters, logs, the engine's socket) can be created and written."""

from __future__ import annotations

import tempfile
from pathlib import Path

from loragate.supervisor.preflight_problem import PreflightProblem


def check_cache_dir(cache_dir: Path) -> PreflightProblem | None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".preflight-") as probe:
            probe.write(b"ok")
            probe.flush()
    except (FileExistsError, NotADirectoryError):
        message = (
            f"The cache directory {cache_dir} cannot be created because it or a parent is a "
            "file: remove that file or pass --cache-dir with a writable directory."
        )
    except OSError as exc:
        message = (
            f"The cache directory {cache_dir} is not writable ({exc.strerror or exc}): fix "
            "its permissions or pass --cache-dir with a writable directory."
        )
    else:
        return None
    return PreflightProblem("cache_dir", message)
