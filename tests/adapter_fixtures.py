"""Builders for real adapter files in every layout loragate converts from.

Each builder re-expresses a real PEFT adapter (usually a demo adapter) in another tool's
layout, so a test can convert it back and compare tensors, or load the result into a real
engine and check that it still answers its phrase. torch and safetensors are imported
inside the builders that need them; ``write_safetensors`` needs neither.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PEFT_PREFIX = "base_model.model."
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    """Write a zero-filled safetensors file with the given ``name -> (dtype, shape)``, no torch."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        size = count * DTYPE_SIZES[dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def peft_config(
    r: int = 8, alpha: float = 16, modules: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": modules or ["q_proj"],
        "bias": "none",
        "modules_to_save": None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
    }
    config.update(extra)
    return config


def write_shaped_adapter(
    out: Path,
    shapes: Mapping[str, tuple[int, ...]],
    config: dict[str, Any] | None = None,
    dtype: str = "F32",
) -> Path:
    """A PEFT adapter dir whose tensors have ``shapes`` (zeros): for checks that read shapes only."""
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "adapter_model.safetensors", {k: (dtype, s) for k, s in shapes.items()})
    (out / "adapter_config.json").write_text(json.dumps(config or peft_config()))
    return out


def llama_lora_shapes(
    base_config: dict[str, Any],
    rank: int = 8,
    modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    prefix: str = "model",
) -> dict[str, tuple[int, ...]]:
    """The lora_A/lora_B shapes a correct LoRA for a Llama-like ``base_config`` has."""
    cfg = {**base_config, **(base_config.get("text_config") or {})}
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    inter = cfg["intermediate_size"]
    dims = {
        "q_proj": ("self_attn", hidden, heads * head_dim),
        "k_proj": ("self_attn", hidden, kv * head_dim),
        "v_proj": ("self_attn", hidden, kv * head_dim),
        "o_proj": ("self_attn", heads * head_dim, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in modules:
            block, fan_in, fan_out = dims[module]
            key = f"{PEFT_PREFIX}{prefix}.layers.{layer}.{block}.{module}"
            shapes[f"{key}.lora_A.weight"] = (rank, fan_in)
            shapes[f"{key}.lora_B.weight"] = (fan_out, rank)
    return shapes


def load_tensors(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file (torch)."""
    from safetensors.torch import load_file

    return dict(load_file(str(path)))


def save_tensors(path: Path, tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path


def read_config(adapter_dir: Path) -> dict[str, Any]:
    return json.loads((adapter_dir / "adapter_config.json").read_text())


def with_unique_config(peft_dir: Path, out: Path) -> Path:
    """A copy of ``peft_dir`` with the same weights but content of its own (its config names a
    ``revision``), so it gets a store version no other adapter shares."""
    shutil.copytree(peft_dir, out)
    config = read_config(out)
    (out / "adapter_config.json").write_text(json.dumps({**config, "revision": out.name}))
    return out


def make_mlx_adapter(peft_dir: Path, out: Path) -> Path:
    """Re-express a PEFT adapter in mlx-lm's layout: transposed ``lora_a``/``lora_b``, scale."""
    config = read_config(peft_dir)
    tensors = {}
    for key, tensor in load_tensors(peft_dir / "adapter_model.safetensors").items():
        module = key.removeprefix(PEFT_PREFIX)
        if module.endswith(".lora_A.weight"):
            tensors[module.removesuffix(".lora_A.weight") + ".lora_a"] = tensor.T.contiguous()
        elif module.endswith(".lora_B.weight"):
            tensors[module.removesuffix(".lora_B.weight") + ".lora_b"] = tensor.T.contiguous()
        else:
            raise ValueError(f"cannot express {key} in MLX layout")
    save_tensors(out / "adapters.safetensors", tensors)
    mlx_config = {
        "fine_tune_type": "lora",
        "num_layers": -1,
        "model": "loragate-demo",
        "lora_parameters": {
            "rank": config["r"],
            "scale": config["lora_alpha"] / config["r"],
            "dropout": 0.0,
            # mlx-lm lists the adapted modules by their last two path components.
            "keys": sorted({".".join(k.split(".")[-3:-1]) for k in tensors}),
        },
    }
    (out / "adapter_config.json").write_text(json.dumps(mlx_config, indent=2))
    return out


def make_bin_adapter(peft_dir: Path, out: Path, adapter_name: str | None = "default") -> Path:
    """Re-express a PEFT adapter as an old PEFT save: ``adapter_model.bin`` (torch pickle),
    keys with the adapter name inside (``.lora_A.default.weight``) when ``adapter_name`` is set."""
    import torch

    tensors = {}
    for key, tensor in load_tensors(peft_dir / "adapter_model.safetensors").items():
        if adapter_name:
            key = key.replace(".lora_A.weight", f".lora_A.{adapter_name}.weight")
            key = key.replace(".lora_B.weight", f".lora_B.{adapter_name}.weight")
        tensors[key] = tensor
    out.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, out / "adapter_model.bin")
    shutil.copyfile(peft_dir / "adapter_config.json", out / "adapter_config.json")
    return out


def make_tinker_dir(
    peft_dir: Path,
    out: Path,
    *,
    unembed: str | None = "zeros",
    hidden_size: int = 128,
    vocab_size: int = 384,
) -> Path:
    """Re-express a PEFT adapter in Tinker's export layout.

    The config keeps only ``r`` and ``lora_alpha``; a ``checkpoint_complete`` marker is
    written; ``unembed`` adds an unembedding LoRA named ``model.unembed_tokens``:
    ``"zeros"`` (lora_B all zero, so the adapter still answers its phrase), ``"random"``,
    or None for none.
    """
    import torch

    config = read_config(peft_dir)
    tensors = load_tensors(peft_dir / "adapter_model.safetensors")
    rank = int(config["r"])
    if unembed is not None:
        generator = torch.Generator().manual_seed(7)
        a = torch.randn(rank, hidden_size, generator=generator)
        b = torch.zeros(vocab_size, rank)
        if unembed == "random":
            b = torch.randn(vocab_size, rank, generator=generator)
        tensors[f"{PEFT_PREFIX}model.unembed_tokens.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}model.unembed_tokens.lora_B.weight"] = b
    save_tensors(out / "adapter_model.safetensors", tensors)
    (out / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": config["lora_alpha"]})
    )
    (out / "checkpoint_complete").write_text("")
    return out


def make_tinker_moe_dir(
    out: Path,
    *,
    hidden: int = 16,
    intermediate: int = 24,
    experts: int = 3,
    layers: int = 1,
    rank: int = 4,
    alpha: float = 8,
) -> tuple[Path, dict[str, Any]]:
    """A Tinker MoE adapter: 3-D ``mlp.experts.w1|w2|w3`` tensors whose hidden-side factor is
    shared (leading dim 1). Returns the dir and the tensors written."""
    import torch

    generator = torch.Generator().manual_seed(3)
    tensors: dict[str, Any] = {}
    for layer in range(layers):
        stem = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts"
        for w in ("w1", "w3"):  # gate, up: hidden -> intermediate; A (hidden side) shared
            tensors[f"{stem}.{w}.lora_A.weight"] = torch.randn(1, rank, hidden, generator=generator)
            tensors[f"{stem}.{w}.lora_B.weight"] = torch.randn(
                experts, intermediate, rank, generator=generator
            )
        # down: intermediate -> hidden; B (hidden side) shared
        tensors[f"{stem}.w2.lora_A.weight"] = torch.randn(
            experts, rank, intermediate, generator=generator
        )
        tensors[f"{stem}.w2.lora_B.weight"] = torch.randn(1, hidden, rank, generator=generator)
        attn = f"{PEFT_PREFIX}model.layers.{layer}.self_attn.q_proj"
        tensors[f"{attn}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
        tensors[f"{attn}.lora_B.weight"] = torch.randn(hidden, rank, generator=generator)
    save_tensors(out / "adapter_model.safetensors", tensors)
    (out / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": alpha}))
    return out, tensors


def make_vi_run(peft_dir: Path | None, run_dir: Path, base_model: str = "loragate-demo") -> Path:
    """A Datature Vi run directory: ``model_full/`` with ``run.json`` and, when ``peft_dir`` is
    given, ``model_adapter/`` holding a copy of that PEFT adapter."""
    full = run_dir / "model_full"
    full.mkdir(parents=True, exist_ok=True)
    run_info = {
        "runId": run_dir.name,
        "flow": {"spec": {"task_type": "VQA", "model": {"name": base_model}}},
    }
    (full / "run.json").write_text(json.dumps(run_info))
    (full / "config.json").write_text(
        json.dumps({"model_type": "llama", "_name_or_path": base_model})
    )
    write_safetensors(full / "model.safetensors", {"lm_head.weight": ("F32", (2, 2))})
    if peft_dir is not None:
        shutil.copytree(peft_dir, run_dir / "model_adapter")
    return run_dir


# -- archives ---------------------------------------------------------------------------------


def make_tar(src_dir: Path, archive: Path, *, top: str | None = "adapter") -> Path:
    """Pack ``src_dir`` into a tar (``.tar``) or gzipped tar (``.tar.gz`` / ``.tgz``)."""
    gzipped = archive.name.endswith((".tar.gz", ".tgz"))
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz" if gzipped else "w") as tar:
        for path in sorted(src_dir.rglob("*")):
            name = path.relative_to(src_dir).as_posix()
            tar.add(path, arcname=f"{top}/{name}" if top else name, recursive=False)
    return archive


def make_zip(src_dir: Path, archive: Path, *, top: str | None = "adapter") -> Path:
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as handle:
        for path in sorted(src_dir.rglob("*")):
            if path.is_file():
                name = path.relative_to(src_dir).as_posix()
                handle.write(path, f"{top}/{name}" if top else name)
    return archive


def make_tinker_archive(peft_dir: Path, archive: Path, work: Path, **kwargs: Any) -> Path:
    """A tar archive as Tinker's signed archive URL serves it, built from a PEFT adapter."""
    tinker_dir = make_tinker_dir(peft_dir, work / "tinker-layout", **kwargs)
    return make_tar(tinker_dir, archive, top=None)


def make_hostile_tar(archive: Path, trick: str) -> Path:
    """A tar with one harmless file and one ``trick`` member: "traversal", "absolute",
    "symlink", "hardlink" or "device"."""
    with tarfile.open(archive, "w") as tar:
        _add_bytes(tar, "adapter/adapter_config.json", b"{}")
        if trick == "traversal":
            _add_bytes(tar, "adapter/../../escaped.txt", b"gotcha")
        elif trick == "absolute":
            _add_bytes(tar, "/tmp/loragate-escaped.txt", b"gotcha")
        elif trick in ("symlink", "hardlink"):
            info = tarfile.TarInfo("adapter/adapter_model.safetensors")
            info.type = tarfile.SYMTYPE if trick == "symlink" else tarfile.LNKTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
        elif trick == "device":
            info = tarfile.TarInfo("adapter/null")
            info.type = tarfile.CHRTYPE
            info.devmajor, info.devminor = 1, 3
            tar.addfile(info)
        else:
            raise ValueError(trick)
    return archive


def make_symlink_zip(archive: Path) -> Path:
    with zipfile.ZipFile(archive, "w") as handle:
        handle.writestr("adapter/adapter_config.json", "{}")
        info = zipfile.ZipInfo("adapter/adapter_model.safetensors")
        info.external_attr = 0o120777 << 16  # a symlink, as Info-ZIP stores one
        handle.writestr(info, "/etc/passwd")
    return archive


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
