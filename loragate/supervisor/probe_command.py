"""Running a short command for a preflight check (the engine's Python, ``nvidia-smi``) without
letting a hung or missing program stop the gateway's start."""

from __future__ import annotations

import subprocess

# How long the engine's Python may take to answer (importlib lookups, no vLLM import).
ENGINE_PYTHON_TIMEOUT = 60.0


def run_probe(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | str:
    """The finished process, or why it could not run."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
