"""The engine's log file under the cache dir, and reading its last lines for error reports."""

from __future__ import annotations

import os
import re
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


# What a vLLM boot is doing, from the last of its log lines that says so (newest first wins).
_BOOT_PHASES = (
    ("Supported tasks", "opening its API"),
    ("init engine (profile, create kv cache", "warmed up, opening its API"),
    ("KV cache", "allocating the KV cache and warming up"),
    ("Loading weights took", "weights loaded, setting up LoRA and the KV cache"),
    ("Starting to load model", "loading the model's weights"),
    ("Loading safetensors checkpoint", "loading the model's weights"),
    ("Initializing a V1 LLM engine", "starting its engine core and workers"),
    ("non-default args", "reading the model's configuration"),
)
_VLLM_PREFIX = re.compile(r"^\(\S+ pid=\d+\)\s+[A-Z]+\s+\S+\s+\S+\s+\[[^\]]*\]\s*")


def boot_phase(lines: list[str]) -> str:
    """A short account of how far an engine boot has come, from its log's last ``lines``."""
    for line in reversed(lines):
        for marker, phase in _BOOT_PHASES:
            if marker in line:
                return phase
    for line in reversed(lines):
        message = _VLLM_PREFIX.sub("", line).strip()
        if message and _VLLM_PREFIX.match(line):
            return message[:120]
    return "starting Python and importing vLLM"
