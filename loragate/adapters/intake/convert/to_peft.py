"""Write the adapter in a source directory out as exactly ``adapter_config.json`` +
``adapter_model.safetensors``: load its tensors by layout, rename them to PEFT's keys, rebuild
the config. A plain PEFT adapter is copied byte for byte (no torch needed)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loragate.adapters.intake.convert.detect import (
    ADAPTER_NAME,
    already_normal,
    detect_format,
    read_json,
)
from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.mlx import from_mlx, load_mlx
from loragate.adapters.intake.convert.peft_bin import load_peft_bin
from loragate.adapters.intake.convert.peft_config import build_peft_config
from loragate.adapters.intake.convert.tensors import Tensors, load_safetensors, save_safetensors
from loragate.adapters.intake.convert.tinker import from_tinker
from loragate.adapters.intake.peft_layout import CONFIG_FILENAME, WEIGHTS_FILENAME
from loragate.adapters.intake.safetensors_header import read_safetensors_header
from loragate.base_model.vi_runs import VI_ADAPTER_DIRNAME, VI_FULL_DIRNAME


def convert_to_peft(
    src_dir: Path,
    out_dir: Path,
    base_config: dict[str, Any] | None = None,
    base_model: str | None = None,
) -> Path:
    """Convert the adapter in ``src_dir`` into a PEFT adapter in ``out_dir`` (absent or empty).

    ``base_config`` (the base model's config.json) decides where Tinker's unembedding LoRA
    goes (``lm_head``, or ``embed_tokens`` when embeddings are tied) and the decoder prefix
    of vision-language models; ``base_model`` fills ``base_model_name_or_path``.
    """
    fmt = detect_format(src_dir)
    if fmt == "vi-run":
        return _convert_vi_run(src_dir, out_dir, base_config, base_model)
    src_config = read_json(src_dir / CONFIG_FILENAME)
    created = _prepare_out(out_dir)
    try:
        _write_converted(src_dir, out_dir, fmt, src_config, base_config, base_model)
    except BaseException:
        for name in (WEIGHTS_FILENAME, CONFIG_FILENAME):
            (out_dir / f".{name}.tmp").unlink(missing_ok=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    return out_dir


def _load_peft(src_dir: Path) -> Tensors:
    return load_safetensors(src_dir / WEIGHTS_FILENAME)


_LOADERS: dict[str, Callable[[Path], Tensors]] = {
    "peft": _load_peft,
    "peft-bin": load_peft_bin,
    "tinker": _load_peft,
    "mlx": load_mlx,
}


def _write_converted(
    src_dir: Path,
    out_dir: Path,
    fmt: str,
    src_config: dict[str, Any],
    base_config: dict[str, Any] | None,
    base_model: str | None,
) -> None:
    if fmt == "peft" and already_normal(src_dir / WEIGHTS_FILENAME):
        # Nothing to rename: copy the bytes, so plain PEFT adapters need no torch at all.
        shapes = read_safetensors_header(src_dir / WEIGHTS_FILENAME).shapes()
        config = build_peft_config(src_config, shapes, fmt, base_model)
        shutil.copyfile(src_dir / WEIGHTS_FILENAME, out_dir / f".{WEIGHTS_FILENAME}.tmp")
    else:
        tensors = _LOADERS[fmt](src_dir)
        tensors = _normalise(tensors, fmt, base_config or {})
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        config = build_peft_config(src_config, shapes, fmt, base_model)
        save_safetensors(tensors, out_dir / f".{WEIGHTS_FILENAME}.tmp")
    (out_dir / f".{CONFIG_FILENAME}.tmp").write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(out_dir / f".{WEIGHTS_FILENAME}.tmp", out_dir / WEIGHTS_FILENAME)
    os.replace(out_dir / f".{CONFIG_FILENAME}.tmp", out_dir / CONFIG_FILENAME)


def _convert_vi_run(
    run_dir: Path, out_dir: Path, base_config: dict[str, Any] | None, base_model: str | None
) -> Path:
    adapter_dir = run_dir / VI_ADAPTER_DIRNAME
    if not adapter_dir.is_dir():
        raise ConversionError(
            f"Vi run {run_dir} has no {VI_ADAPTER_DIRNAME}/ (a full fine-tune): serve its "
            f"{VI_FULL_DIRNAME}/ as the base model instead (gateway serve --model "
            f"{run_dir / VI_FULL_DIRNAME})"
        )
    return convert_to_peft(adapter_dir, out_dir, base_config, base_model)


def _prepare_out(out_dir: Path) -> bool:
    """Make ``out_dir`` ready; True if this call created it."""
    if out_dir.exists():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise ConversionError(
                f"output directory {out_dir} is not empty; choose a new directory"
            )
        return False
    out_dir.mkdir(parents=True)
    return True


def _normalise(tensors: Tensors, fmt: str, base_config: dict[str, Any]) -> Tensors:
    if fmt == "mlx":
        tensors = from_mlx(tensors)
    if fmt == "tinker":
        tensors = from_tinker(tensors, base_config)
    renamed: Tensors = {}
    for name, tensor in tensors.items():
        new = ADAPTER_NAME.sub(r".\1", name)
        if new in renamed:
            raise ConversionError(f"two tensors map to {new!r}; the adapter holds two adapters")
        renamed[new] = tensor
    return renamed
