"""``peft-bin``: an old PEFT save, ``adapter_model.bin`` (a torch pickle, read with
``weights_only=True`` so it cannot run code). Its keys are PEFT's, renamed like ``peft``."""

from __future__ import annotations

from pathlib import Path

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.tensors import Tensors, missing_extra

BIN_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")


def load_peft_bin(src_dir: Path) -> Tensors:
    path = next(src_dir / name for name in BIN_WEIGHTS if (src_dir / name).is_file())
    try:
        import torch
    except ImportError as exc:
        raise ConversionError(missing_extra(exc)) from exc
    try:
        # weights_only: a pickle from the internet must not be able to run code here.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConversionError(
            f"cannot read {path} as a torch state dict of tensors ({exc}); re-save the adapter "
            "with PEFT's save_pretrained(safe_serialization=True)"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{path} is not a dict of tensors")
    return {str(k): v for k, v in state.items()}
