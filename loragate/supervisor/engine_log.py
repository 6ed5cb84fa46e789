"""The engine's log file under the cache dir, and reading its last lines for error reports."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO

MAX_LOG_BYTES = 20 * 1024 * 1024


def open_engine_log(path: Path) -> BinaryIO:
    """Open the log for appending (rotating it once past ``MAX_LOG_BYTES``), with a boot banner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > MAX_LOG_BYTES:
        os.replace(path, path.with_suffix(path.suffix + ".1"))
    handle = path.open("ab", buffering=0)
    handle.write(
        f"\n===== loragate: engine boot at {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode()
    )
    return handle


def tail_lines(path: Path, count: int = 40, max_bytes: int = 64 * 1024) -> list[str]:
    """The last ``count`` lines of ``path`` (from the last ``max_bytes`` only), or [] if absent."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-count:]
