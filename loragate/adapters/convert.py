"""Convert adapters from the formats people train in to the PEFT layout vLLM loads.

Supported inputs (``detect_format`` names them):

- ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors``; keys with the PEFT
  adapter name inside (``.lora_A.default.weight``) are renamed, the config completed.
- ``peft-bin``: an old PEFT save, ``adapter_model.bin`` (a torch pickle, read with
  ``weights_only=True`` so it cannot run code).
- ``tinker``: Tinker's export: PEFT-like keys, the unembedding LoRA named
  ``model.unembed_tokens``, MoE experts as 3-D ``mlp.experts.w1|w2|w3`` tensors, and a
  config that often holds only ``r`` and ``lora_alpha``.
- ``mlx``: ``adapters.safetensors`` with ``lora_a`` (in, r) / ``lora_b`` (r, out) keys and
  ``lora_parameters {rank, scale}`` in ``adapter_config.json``.
- ``vi-run``: a Datature Vi training run directory; its ``model_adapter/`` is converted.

The output is exactly ``adapter_config.json`` + ``adapter_model.safetensors``. torch and
safetensors are imported only inside the functions that need them; the gateway calls
``convert_in_subprocess`` so that its own process never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loragate.adapters.safetensors_header import SafetensorsError, read_safetensors_header
from loragate.adapters.validate import (
    CONFIG_FILENAME,
    KEY_PREFIX,
    WEIGHTS_FILENAME,
    split_lora_key,
    ties_embeddings,
)
from loragate.adapters.vi_runs import VI_ADAPTER_DIRNAME, VI_FULL_DIRNAME, is_vi_run

FORMATS = ("peft", "peft-bin", "tinker", "mlx", "vi-run")
MLX_WEIGHTS = "adapters.safetensors"
MLX_DEFAULT_SCALE = 20.0  # mlx-lm's default lora_parameters.scale
BIN_WEIGHTS = ("adapter_model.bin", "adapter_model.pt")
TINKER_MARKER = "checkpoint_complete"
# Tinker names the MoE expert projections w1/w2/w3 like Mixtral: w1 = gate, w2 = down, w3 = up.
TINKER_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
ERROR_MARKER = "loragate-convert-error: "
# Config fields carried over from a PEFT config as they are; everything else is rebuilt.
KEPT_FIELDS = (
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "modules_to_save",
    "bias",
    "lora_dropout",
    "task_type",
)

_ADAPTER_NAME = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.default(?=\.|$)")
_TINKER_EXPERTS = re.compile(
    r"^(?P<stem>.+\.mlp\.experts)\.(?P<w>w[123])\.(?P<ab>lora_[AB])\.weight$"
)
_TINKER_UNEMBED = re.compile(
    r"^base_model\.model\.model\.unembed_tokens\.(?P<ab>lora_[AB])\.weight$"
)
_MLX_KEY = re.compile(r"^(?P<module>.+)\.(?P<ab>lora_[ab])$")

Tensors = dict[str, Any]  # name -> torch.Tensor; typed loosely so this module needs no torch


class ConversionError(ValueError):
    """The source cannot be converted; the message says why and what to do."""


def detect_format(src_dir: Path) -> str:
    """Name the adapter layout in ``src_dir``: one of ``FORMATS``."""
    if not src_dir.is_dir():
        raise ConversionError(f"{src_dir} is not a directory")
    if is_vi_run(src_dir):
        return "vi-run"
    if (src_dir / MLX_WEIGHTS).is_file():
        return "mlx"
    weights = src_dir / WEIGHTS_FILENAME
    if weights.is_file():
        return "tinker" if _looks_like_tinker(src_dir, weights) else "peft"
    if any((src_dir / name).is_file() for name in BIN_WEIGHTS):
        return "peft-bin"
    found = sorted(p.name for p in src_dir.iterdir())[:12]
    raise ConversionError(
        f"{src_dir} holds no adapter I know (found: {', '.join(found) or 'nothing'}). Expected a "
        f"PEFT adapter ({CONFIG_FILENAME} + {WEIGHTS_FILENAME} or adapter_model.bin), a Tinker "
        f"export, an MLX adapter ({MLX_WEIGHTS}) or a Datature Vi run (model_adapter/)"
    )


def _looks_like_tinker(src_dir: Path, weights: Path) -> bool:
    if (src_dir / TINKER_MARKER).exists():
        return True
    try:
        names = read_safetensors_header(weights).tensors
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    if any(_TINKER_UNEMBED.match(n) or _TINKER_EXPERTS.match(n) for n in names):
        return True
    config = _read_json(src_dir / CONFIG_FILENAME)
    return bool(config) and "peft_type" not in config and "target_modules" not in config


def needs_conversion(src_dir: Path) -> bool:
    """False only for a PEFT adapter vLLM loads as it is: plain keys and a complete config.

    Cheap (reads JSON and the safetensors header), so the gateway can skip the converter
    process for the common case.
    """
    if detect_format(src_dir) != "peft" or not _already_normal(src_dir / WEIGHTS_FILENAME):
        return True
    config = _read_json(src_dir / CONFIG_FILENAME)
    required = ("peft_type", "r", "lora_alpha", "target_modules")
    return any(config.get(field) in (None, "", []) for field in required)


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
    src_config = _read_json(src_dir / CONFIG_FILENAME)
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


def _write_converted(
    src_dir: Path,
    out_dir: Path,
    fmt: str,
    src_config: dict[str, Any],
    base_config: dict[str, Any] | None,
    base_model: str | None,
) -> None:
    if fmt == "peft" and _already_normal(src_dir / WEIGHTS_FILENAME):
        # Nothing to rename: copy the bytes, so plain PEFT adapters need no torch at all.
        shapes = read_safetensors_header(src_dir / WEIGHTS_FILENAME).shapes()
        config = build_peft_config(src_config, shapes, fmt, base_model)
        shutil.copyfile(src_dir / WEIGHTS_FILENAME, out_dir / f".{WEIGHTS_FILENAME}.tmp")
    else:
        tensors = _LOADERS[fmt](src_dir)
        tensors = _normalise(tensors, fmt, base_config or {})
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        config = build_peft_config(src_config, shapes, fmt, base_model)
        _save_safetensors(tensors, out_dir / f".{WEIGHTS_FILENAME}.tmp")
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


def _already_normal(weights: Path) -> bool:
    try:
        names = read_safetensors_header(weights).tensors
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    return not any(_ADAPTER_NAME.search(n) for n in names)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc}); fix or re-export it") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return data


# -- loading ---------------------------------------------------------------------------------


def _load_safetensors(path: Path) -> Tensors:
    try:
        read_safetensors_header(path)  # a clear message for truncated files
        from safetensors.torch import load_file
    except SafetensorsError as exc:
        raise ConversionError(str(exc)) from exc
    except ImportError as exc:
        raise ConversionError(_missing_extra(exc)) from exc
    return dict(load_file(str(path), device="cpu"))


def _load_peft(src_dir: Path) -> Tensors:
    return _load_safetensors(src_dir / WEIGHTS_FILENAME)


def _load_mlx(src_dir: Path) -> Tensors:
    return _load_safetensors(src_dir / MLX_WEIGHTS)


def _load_bin(src_dir: Path) -> Tensors:
    path = next(src_dir / name for name in BIN_WEIGHTS if (src_dir / name).is_file())
    try:
        import torch
    except ImportError as exc:
        raise ConversionError(_missing_extra(exc)) from exc
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


_LOADERS: dict[str, Callable[[Path], Tensors]] = {
    "peft": _load_peft,
    "peft-bin": _load_bin,
    "tinker": _load_peft,
    "mlx": _load_mlx,
}


def _missing_extra(exc: ImportError) -> str:
    return (
        f"converting this adapter needs torch and safetensors ({exc}); install them with "
        "pip install 'loragate[convert]' and torch, or run the conversion with the engine's Python"
    )


def _save_safetensors(tensors: Tensors, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(path),
        metadata={"format": "pt"},
    )


# -- renaming --------------------------------------------------------------------------------


def _normalise(tensors: Tensors, fmt: str, base_config: dict[str, Any]) -> Tensors:
    if fmt == "mlx":
        tensors = _from_mlx(tensors)
    if fmt == "tinker":
        tensors = _from_tinker(tensors, base_config)
    renamed: Tensors = {}
    for name, tensor in tensors.items():
        new = _ADAPTER_NAME.sub(r".\1", name)
        if new in renamed:
            raise ConversionError(f"two tensors map to {new!r}; the adapter holds two adapters")
        renamed[new] = tensor
    return renamed


def _from_mlx(tensors: Tensors) -> Tensors:
    out: Tensors = {}
    for name, tensor in tensors.items():
        match = _MLX_KEY.match(name)
        if match is None:
            raise ConversionError(
                f"MLX tensor {name!r} is not a LoRA weight (expected '<module>.lora_a' / "
                "'.lora_b'); DoRA and fully trained layers cannot be served as a LoRA"
            )
        module, side = match["module"], match["ab"][-1].upper()
        if tensor.dim() != 2:
            raise ConversionError(
                f"MLX tensor {name!r} has shape {list(tensor.shape)}, not a matrix"
            )
        if module.endswith("embed_tokens"):
            # MLX keeps (num_embeddings, r) / (r, dims); PEFT's embedding LoRA is the transpose.
            key = f"{KEY_PREFIX}{module}.lora_embedding_{side}"
        else:
            key = f"{KEY_PREFIX}{module}.lora_{side}.weight"
        out[key] = tensor.T.contiguous()
    return out


def _from_tinker(tensors: Tensors, base_config: dict[str, Any]) -> Tensors:
    tied = ties_embeddings(base_config)
    text_prefix = _tinker_text_prefix(base_config)
    out: Tensors = {}
    experts: dict[tuple[str, str], dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if match := _TINKER_UNEMBED.match(name):
            module = "model.embed_tokens" if tied else "lm_head"
            out[f"{KEY_PREFIX}{module}.{match['ab']}.weight"] = tensor
        elif match := _TINKER_EXPERTS.match(name):
            experts.setdefault((match["stem"], match["w"]), {})[match["ab"]] = tensor
        else:
            out[name] = tensor
    for (stem, w), sides in sorted(experts.items()):
        out.update(_split_experts(stem, w, sides))
    if text_prefix != "model":
        out = {_with_text_prefix(name, text_prefix): t for name, t in out.items()}
    return out


def _tinker_text_prefix(base_config: dict[str, Any]) -> str:
    # Tinker leaves out the text-model prefix of vision-language models.
    if not isinstance(base_config.get("text_config"), dict):
        return "model"
    return (
        "model.text_model"
        if base_config.get("model_type") == "idefics3"
        else "model.language_model"
    )


def _with_text_prefix(name: str, prefix: str) -> str:
    head = f"{KEY_PREFIX}model."
    if name.startswith(head) and not name.startswith(f"{KEY_PREFIX}{prefix}."):
        return f"{KEY_PREFIX}{prefix}.{name[len(head) :]}"
    return name


def _split_experts(stem: str, w: str, sides: dict[str, Any]) -> Tensors:
    """Split Tinker's 3-D expert LoRA into one 2-D pair per expert; a side of length 1 is shared."""
    if set(sides) != {"lora_A", "lora_B"}:
        raise ConversionError(f"{stem}.{w} has only {', '.join(sides)}; the adapter is incomplete")
    a, b = sides["lora_A"], sides["lora_B"]
    if a.dim() != 3 or b.dim() != 3:
        raise ConversionError(f"{stem}.{w} expert LoRA tensors must be 3-D (experts, rows, cols)")
    count = max(a.shape[0], b.shape[0])
    if {a.shape[0], b.shape[0]} - {1, count}:
        raise ConversionError(
            f"{stem}.{w}: lora_A covers {a.shape[0]} experts but lora_B covers {b.shape[0]}"
        )
    proj = TINKER_EXPERT_PROJ[w]
    out: Tensors = {}
    for expert in range(count):
        # clone: safetensors refuses to save several views of one storage.
        out[f"{stem}.{expert}.{proj}.lora_A.weight"] = a[0 if a.shape[0] == 1 else expert].clone()
        out[f"{stem}.{expert}.{proj}.lora_B.weight"] = b[0 if b.shape[0] == 1 else expert].clone()
    return out


# -- config ----------------------------------------------------------------------------------


def build_peft_config(
    src_config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    fmt: str,
    base_model: str | None,
) -> dict[str, Any]:
    """A complete ``adapter_config.json`` for tensors of ``shapes`` converted from ``fmt``."""
    peft_type = str(src_config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise ConversionError(
            f"the adapter is a {peft_type} adapter; only LoRA adapters can be served"
        )
    modules: set[str] = set()
    ranks: dict[str, int] = {}
    for name, shape in shapes.items():
        split = split_lora_key(name)
        if split is None:
            raise ConversionError(
                f"tensor {name!r} is not a LoRA weight; the adapter cannot be served as a LoRA"
            )
        module, part = split
        modules.add(module.rsplit(".", 1)[-1])
        if part in ("A", "embedding_A"):
            ranks[module] = int(shape[0])
    if not ranks:
        raise ConversionError("the adapter holds no lora_A weights")
    config: dict[str, Any] = {k: src_config[k] for k in KEPT_FIELDS if k in src_config}
    if fmt == "mlx":
        config.update(_mlx_fields(src_config, ranks))
    r = _rank(src_config if fmt != "mlx" else {"r": config["r"]}, ranks)
    alpha = config.get("lora_alpha", src_config.get("lora_alpha"))
    if alpha is None:
        if fmt == "tinker":
            raise ConversionError(
                f"the Tinker {CONFIG_FILENAME} has no lora_alpha; add the value the run was "
                "trained with (Tinker's LoRA rank defaults to 32) and convert again"
            )
        alpha = 8  # PEFT's LoraConfig default: what PEFT itself would load
    config.update(
        {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": alpha,
            "target_modules": sorted(modules),
            "bias": config.get("bias") or "none",
            "task_type": config.get("task_type") or "CAUSAL_LM",
            "modules_to_save": config.get("modules_to_save") or None,
            "base_model_name_or_path": base_model
            or src_config.get("base_model_name_or_path")
            or "",
            "inference_mode": True,
        }
    )
    config.setdefault("use_dora", False)
    config.setdefault("use_rslora", False)
    return config


def _rank(src_config: dict[str, Any], ranks: dict[str, int]) -> int:
    found = sorted(set(ranks.values()))
    declared = src_config.get("r")
    if src_config.get("rank_pattern"):
        return int(declared) if declared else found[-1]
    if len(found) > 1:
        raise ConversionError(
            f"the adapter's modules have different ranks ({', '.join(map(str, found))}) but its "
            "config has no rank_pattern saying which is which; re-export it with PEFT"
        )
    if declared is not None and int(declared) != found[0]:
        raise ConversionError(
            f"{CONFIG_FILENAME} says r={declared} but the weights have rank {found[0]}; the "
            "config does not belong to these weights"
        )
    return found[0]


def _mlx_fields(src_config: dict[str, Any], ranks: dict[str, int]) -> dict[str, Any]:
    if src_config.get("fine_tune_type", "lora") != "lora" or src_config.get("use_dora"):
        raise ConversionError(
            f"the MLX adapter is a {src_config.get('fine_tune_type', 'dora')} fine-tune; only "
            "LoRA adapters can be served (retrain with fine_tune_type: lora)"
        )
    params = src_config.get("lora_parameters") or {}
    rank = int(params.get("rank") or max(ranks.values()))
    scale = float(params.get("scale", MLX_DEFAULT_SCALE))
    alpha = scale * rank
    # PEFT scales by lora_alpha / r; MLX by scale. Keep an int when it is one, like PEFT writes.
    return {"r": rank, "lora_alpha": int(alpha) if alpha.is_integer() else alpha}


# -- subprocess ------------------------------------------------------------------------------


def convert_in_subprocess(
    src: Path,
    out: Path,
    base_model_dir: Path | None,
    *,
    base_model_name: str | None = None,
    python: str | None = None,
    timeout: float = 900.0,
) -> Path:
    """Run ``convert_to_peft`` in a child Python so this process never imports torch.

    ``python`` is the interpreter with torch (the engine's); the child's error message comes
    back as a ``ConversionError``.
    """
    command = [python or sys.executable, "-m", "loragate.adapters.convert", str(src), str(out)]
    if base_model_dir is not None:
        command += ["--base", str(base_model_dir)]
    if base_model_name is not None:
        command += ["--base-model-name", base_model_name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ConversionError(f"converting {src} took longer than {timeout:.0f}s; gave up") from exc
    except OSError as exc:
        raise ConversionError(f"cannot start {command[0]} to convert {src}: {exc}") from exc
    if done.returncode != 0:
        raise ConversionError(_child_error(done.stderr, done.returncode))
    return out


def _child_error(stderr: str, returncode: int) -> str:
    for line in reversed(stderr.splitlines()):
        if line.startswith(ERROR_MARKER):
            return line[len(ERROR_MARKER) :]
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return f"the converter exited with status {returncode}: {tail or 'no output'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loragate.adapters.convert", description="Convert an adapter to PEFT."
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=Path, default=None, help="base model directory")
    parser.add_argument("--base-model-name", default=None, help="base_model_name_or_path to record")
    args = parser.parse_args(argv)
    try:
        base_config = None
        if args.base is not None:
            from loragate.adapters.models import read_base_config

            base_config = read_base_config(args.base)
        name = args.base_model_name or (str(args.base) if args.base is not None else None)
        convert_to_peft(args.src, args.out, base_config, name)
    except (ValueError, OSError) as exc:
        print(f"{ERROR_MARKER}{' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
