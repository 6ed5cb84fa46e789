"""``tinker``: Tinker's export: PEFT-like keys, the unembedding LoRA named
``model.unembed_tokens``, MoE experts as 3-D ``mlp.experts.w1|w2|w3`` tensors, and a config
that often holds only ``r`` and ``lora_alpha``."""

from __future__ import annotations

import re
from typing import Any

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.tensors import Tensors
from loragate.adapters.intake.peft_layout import KEY_PREFIX
from loragate.adapters.intake.validate import ties_embeddings

TINKER_MARKER = "checkpoint_complete"
# Tinker names the MoE expert projections w1/w2/w3 like Mixtral: w1 = gate, w2 = down, w3 = up.
TINKER_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}

_TINKER_EXPERTS = re.compile(
    r"^(?P<stem>.+\.mlp\.experts)\.(?P<w>w[123])\.(?P<ab>lora_[AB])\.weight$"
)
_TINKER_UNEMBED = re.compile(
    r"^base_model\.model\.model\.unembed_tokens\.(?P<ab>lora_[AB])\.weight$"
)


def is_tinker_key(name: str) -> bool:
    """True for a tensor name only Tinker writes: the unembedding or a 3-D expert LoRA."""
    return bool(_TINKER_UNEMBED.match(name) or _TINKER_EXPERTS.match(name))


def from_tinker(tensors: Tensors, base_config: dict[str, Any]) -> Tensors:
    """Tinker's tensors under the names the base model's PEFT LoRA uses.

    ``base_config`` decides where the unembedding LoRA goes (``lm_head``, or
    ``embed_tokens`` when embeddings are tied) and the decoder prefix of vision-language models.
    """
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
