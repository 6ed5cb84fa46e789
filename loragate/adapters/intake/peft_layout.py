"""The PEFT LoRA layout vLLM loads: its file names and the grammar of its tensor keys.

Shared by conversion (which writes this layout) and validation (which checks it), and read
without torch: a key is parsed into the module it targets and the part of the LoRA it holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CONFIG_FILENAME = "adapter_config.json"
WEIGHTS_FILENAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, "embed_tokens", "lm_head")
CONVERT_HINT = "convert it first with `gateway adapters convert SOURCE OUT --base MODEL`"

# Where the decoder's layers live: a text-only model has them under ``model``; a
# vision-language model nests its text model (Idefics3: ``model.text_model``).
TEXT_ONLY_PREFIXES = ("model",)
NESTED_TEXT_PREFIXES = ("model.text_model", "model.language_model", "language_model.model")
_PREFIX = r"(?P<prefix>model|model\.text_model|model\.language_model|language_model\.model)"
_LAYER_MODULE = re.compile(
    _PREFIX + r"\.layers\.(?P<layer>\d+)\."
    r"(?:self_attn\.(?P<attn>[qkvo]_proj)"
    r"|mlp\.(?P<mlp>gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.(?P<expert>\d+)\.(?P<expert_proj>gate_proj|up_proj|down_proj))$"
)
_EMBED_MODULE = re.compile(_PREFIX + r"\.embed_tokens$")
_TINKER_MODULE = re.compile(r"(?:\.mlp\.experts\.w[123]|(?:^|\.)unembed_tokens)$")
_LM_HEAD_MODULE = re.compile(r"(?:language_model\.)?lm_head$")
_PARTS = {
    ".lora_A.weight": "A",
    ".lora_B.weight": "B",
    ".lora_embedding_A": "embedding_A",
    ".lora_embedding_B": "embedding_B",
}


class AdapterRejected(ValueError):
    """The adapter cannot be served; the message says why and what to do."""


@dataclass(frozen=True)
class LoraKey:
    """One tensor key of a PEFT LoRA, split into its parts."""

    key: str
    module: str  # the module path inside the model, e.g. model.layers.0.self_attn.q_proj
    part: str  # "A", "B", "embedding_A" or "embedding_B"
    kind: str  # one of SUPPORTED_MODULES
    prefix: str | None  # the decoder prefix, None for lm_head
    layer: int | None
    expert: int | None


def split_lora_key(key: str) -> tuple[str, str] | None:
    """``(module path, part)`` for a PEFT LoRA tensor key, or None if it is not one."""
    if not key.startswith(KEY_PREFIX):
        return None
    for suffix, part in _PARTS.items():
        if key.endswith(suffix):
            return key[len(KEY_PREFIX) : -len(suffix)], part
    return None


def parse_lora_key(key: str) -> LoraKey:
    """Parse a PEFT LoRA key of a Llama-like model; raise ``AdapterRejected`` if it is not one."""
    if ".default." in key or key.endswith(".default"):
        raise AdapterRejected(
            f"tensor {key!r} has the PEFT adapter name 'default' inside its key, which vLLM "
            f"rejects; {CONVERT_HINT} (it removes the name)"
        )
    split = split_lora_key(key)
    if split is None:
        raise AdapterRejected(
            f"tensor {key!r} is not a LoRA weight (expected keys like "
            f"'base_model.model.<module>.lora_A.weight' and '.lora_B.weight'); "
            "DoRA magnitudes, biases and fully trained modules cannot be served as a LoRA"
        )
    module, part = split
    if _TINKER_MODULE.search(module):
        raise AdapterRejected(
            f"tensor {key!r} is in Tinker's export layout (3-D expert tensors or "
            f"unembed_tokens), which vLLM does not load; {CONVERT_HINT}"
        )
    if match := _LAYER_MODULE.match(module):
        kind = match["attn"] or match["mlp"] or match["expert_proj"]
        expert = int(match["expert"]) if match["expert"] is not None else None
        return LoraKey(key, module, part, kind, match["prefix"], int(match["layer"]), expert)
    if match := _EMBED_MODULE.match(module):
        return LoraKey(key, module, part, "embed_tokens", match["prefix"], None, None)
    if _LM_HEAD_MODULE.fullmatch(module):
        return LoraKey(key, module, part, "lm_head", None, None, None)
    raise AdapterRejected(
        f"tensor {key!r} targets module {module!r}, which vLLM cannot apply a LoRA to on a "
        f"Llama-like model (supported: {', '.join(SUPPORTED_MODULES)})"
    )
