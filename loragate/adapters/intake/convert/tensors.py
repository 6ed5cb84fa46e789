"""Reading and writing tensor files for conversion. torch and safetensors are imported only
inside these functions, so importing the converter costs nothing in the gateway process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.safetensors_header import SafetensorsError, read_safetensors_header

Tensors = dict[str, Any]  # name -> torch.Tensor; typed loosely so this module needs no torch


def load_safetensors(path: Path) -> Tensors:
    try:
        read_safetensors_header(path)  # a clear message for truncated files
        from safetensors.torch import load_file
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    except ImportError as exc:
        raise ConversionError(missing_extra(exc)) from exc
    return dict(load_file(str(path), device="cpu"))


def save_safetensors(tensors: Tensors, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(path),
        metadata={"format": "pt"},
    )


def missing_extra(exc: ImportError) -> str:
    """What to install when torch or safetensors is missing."""
    return (
        f"converting this adapter needs torch and safetensors ({exc}); install them with "
        "pip install 'loragate[convert]' and torch, or run the conversion with the engine's Python"
    )
