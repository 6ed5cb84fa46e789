"""Dequantize a GGUF file into a Hugging Face model directory vLLM serves: safetensors in the
served dtype, the tokenizer with its chat template, and a generation config.

Run as ``python -m loragate.base_model.dequantize SRC.gguf OUT_DIR [--dtype DTYPE]`` (DTYPE
bfloat16, the default, float16 or float32; ``loragate.base_model.gguf.gguf_dtype`` picks it)
with the engine's python (it needs torch, transformers and gguf); ``loragate.base_model.gguf``
does that in a child process, so the gateway never imports them. Errors meant for the user are printed as
one line starting with ``loragate-gguf-error: `` and exit with code 2.

transformers does the dequantizing (``from_pretrained(dir, gguf_file=NAME)``), but the model
it loads keeps a ``quantization_config`` that makes ``save_pretrained`` refuse ("quantized
with gguf and is not serializable"). So the weights move into a fresh model built from the
config without it, built on the meta device and filled with ``assign=True`` so that the
weights are held once, not twice.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from loragate.base_model.gguf import (
    DEFAULT_GGUF_DTYPE,
    GGUF_DTYPES,
    INFO_FILENAME,
    PROGRESS_PREFIX,
    USER_ERROR_EXIT,
    USER_ERROR_PREFIX,
)

INSTALL_HINT = "install loragate's convert extra into it (pip install 'loragate[convert]')"
# Stored as floats in GGUF, so nothing to dequantize; everything else needs gguf.quants.
_PLAIN_TYPES = ("F32", "F16", "BF16")


class DequantizeError(Exception):
    """A problem the user can fix; its message is the whole story."""


def dequantize(src: Path, out: Path, *, dtype: str) -> dict[str, Any]:
    """Write the model directory for ``src`` into ``out`` with weights in ``dtype`` (a
    ``GGUF_DTYPES`` value); returns what ``INFO_FILENAME`` holds.

    transformers dequantizes each tensor to float32 and the model casts it to ``dtype`` as it
    loads, so a bfloat16 conversion holds the float32 one's values rounded to bfloat16."""
    if dtype not in GGUF_DTYPES.values():
        raise DequantizeError(
            f"cannot dequantize into {dtype!r}: name one of {', '.join(sorted(set(GGUF_DTYPES.values())))}"
        )
    started = time.monotonic()
    info = inspect_gguf(src)
    print(
        f"Dequantizing {src.name} ({info['architecture']}, "
        f"{'/'.join(info['tensor_types'])}) to {dtype} into {out} ...",
        flush=True,
    )
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise DequantizeError(
            f"{sys.executable} cannot import torch and transformers ({exc}); run the "
            "dequantizer with the engine's python"
        ) from None

    _reuse_gguf_parsing()
    _count_tensors(info["tensor_count"])
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=getattr(torch, dtype)
        )
    except ValueError as exc:
        if "is not supported" in str(exc):
            from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

            known = ", ".join(
                a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")
            )
            raise DequantizeError(
                f"{src.name}: GGUF architecture {info['architecture']!r} is not supported by "
                f"transformers {transformers.__version__}, which loragate uses to dequantize "
                f"(it reads: {known}); convert the original model instead, or upgrade "
                "transformers in the engine's environment"
            ) from None
        raise
    except NotImplementedError as exc:
        raise DequantizeError(f"{src.name}: cannot dequantize it: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    if tokenizer.chat_template is None and info.get("chat_template"):
        tokenizer.chat_template = info["chat_template"]

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    generation = loaded.generation_config
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.bos_token_id is None:
        generation.bos_token_id = tokenizer.bos_token_id
    model.generation_config = generation

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info.pop("chat_template", None)
    info.pop("tensor_count", None)
    info.update(
        {
            "has_chat_template": tokenizer.chat_template is not None,
            "dtype": dtype,
            "transformers": transformers.__version__,
        }
    )
    (out / INFO_FILENAME).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    print(f"Dequantized {src.name} in {time.monotonic() - started:.0f} s.", flush=True)
    return info


def inspect_gguf(src: Path) -> dict[str, Any]:
    """Architecture, name, tensor types and chat template, checked before torch is imported."""
    try:
        import gguf
    except ImportError:
        raise DequantizeError(
            f"reading GGUF needs the gguf package, which {sys.executable} lacks; {INSTALL_HINT}"
        ) from None
    _reuse_gguf_parsing()
    try:
        reader = gguf.GGUFReader(str(src))
    except (ValueError, OSError) as exc:
        raise DequantizeError(f"{src} is not a readable GGUF file: {exc}") from None
    architecture = _string_field(reader, "general.architecture")
    if architecture is None:
        raise DequantizeError(f"{src} names no general.architecture: it is not a model file")
    types = sorted({tensor.tensor_type.name for tensor in reader.tensors})
    readable = getattr(gguf.quants, "_type_traits", None)
    if readable is not None:
        names = {t.name for t in readable} | set(_PLAIN_TYPES)
        unknown = [t for t in types if t not in names]
        if unknown:
            raise DequantizeError(
                f"{src.name}: quantization type {', '.join(unknown)} cannot be dequantized by "
                f"gguf {_version('gguf')} (it reads {', '.join(sorted(names))}); use a file "
                "quantized with one of those"
            )
    return {
        "architecture": architecture,
        "name": _string_field(reader, "general.name"),
        "tensor_types": types,
        "chat_template": _string_field(reader, "tokenizer.chat_template"),
        "tensor_count": len(reader.tensors),
    }


def _count_tensors(total: int) -> None:
    """Print ``PROGRESS_PREFIX done/total`` on stdout as each tensor is dequantized.

    transformers dequantizes tensor by tensor with ``gguf.dequantize``, imported from gguf
    when the weights are read, so wrapping it here counts them; the parent reads the lines
    into the start's progress record (``gguf_model.run_dequantizer``). A line at most once
    per percent: a 7B model has some 300 tensors, a large one thousands.
    """
    import gguf

    plain = getattr(gguf, "_loragate_dequantize", None) or gguf.dequantize
    done = 0
    shown = -1

    def dequantize(data: Any, qtype: Any) -> Any:
        nonlocal done, shown
        result = plain(data, qtype)
        done += 1
        percent = 100 * done // max(total, 1)
        if percent != shown or done == total:
            shown = percent
            print(f"{PROGRESS_PREFIX}{done}/{total}", flush=True)
        return result

    setattr(gguf, "_loragate_dequantize", plain)  # noqa: B010
    setattr(gguf, "dequantize", dequantize)  # noqa: B010


def _reuse_gguf_parsing() -> None:
    """Parse the file's metadata once, not four times, and each tensor name map once.

    transformers builds a ``GGUFReader`` (which parses every metadata field in Python: 49k
    tokenizer strings for SmolLM2) for the config, the weights and the tokenizer, and calls
    ``get_tensor_name_map`` once per module (397 times for SmolLM2); both are imported from
    ``gguf`` at call time, so memoizing them here covers every call. Readers only read. For
    SmolLM2-135M this took the whole conversion from about 100 s to about 40 s on
    2 busy cores, with byte-identical output.
    """
    import functools
    import os

    import gguf

    if getattr(gguf, "_loragate_memoized", False):
        return
    read = functools.lru_cache(maxsize=4)(gguf.GGUFReader)

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        return read(os.path.realpath(path), mode)

    name_map = functools.lru_cache(maxsize=64)(gguf.get_tensor_name_map)
    # setattr, because mypy rightly refuses a function assigned over a class.
    setattr(gguf, "GGUFReader", reader)  # noqa: B010
    setattr(gguf, "get_tensor_name_map", name_map)  # noqa: B010
    setattr(gguf, "_loragate_memoized", True)  # noqa: B010


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def _string_field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (UnicodeDecodeError, TypeError, IndexError):
        return None


def main(argv: list[str]) -> int:
    dtype = DEFAULT_GGUF_DTYPE
    if len(argv) == 4 and argv[2] == "--dtype":
        argv, dtype = argv[:2], argv[3]
    if len(argv) != 2:
        print(
            "usage: python -m loragate.base_model.dequantize SRC.gguf OUT_DIR [--dtype DTYPE]",
            file=sys.stderr,
        )
        return USER_ERROR_EXIT
    try:
        dequantize(Path(argv[0]), Path(argv[1]), dtype=dtype)
    except DequantizeError as exc:
        print(f"{USER_ERROR_PREFIX}{exc}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
