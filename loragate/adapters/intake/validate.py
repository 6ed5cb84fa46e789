"""Check a PEFT LoRA adapter against the base model before it reaches the engine.

vLLM answers a bad adapter with a 500 and a stack trace, or loads it and serves garbage.
Everything here reads only ``adapter_config.json`` and the safetensors header (no torch),
so the gateway can refuse an adapter with a reason the user can act on: which setting is
unsupported, which module has the wrong shape and what the base model expects, which
engine flag to raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.adapters.intake.peft_layout import (
    CONFIG_FILENAME,
    CONVERT_HINT,
    NESTED_TEXT_PREFIXES,
    TEXT_ONLY_PREFIXES,
    WEIGHTS_FILENAME,
    AdapterRejected,
    LoraKey,
    parse_lora_key,
)
from loragate.adapters.intake.safetensors_header import SafetensorsError, read_safetensors_header
from loragate.fetching.json_file import is_finite_number, read_json_object

# vLLM's --max-lora-rank accepts only these values.
VALID_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class AdapterFacts:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int
    num_tensors: int


def text_config_of(base_config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: ``text_config`` merged over the top level for nested models."""
    nested = base_config.get("text_config")
    if isinstance(nested, dict):
        return {**base_config, **nested}
    return base_config


def ties_embeddings(base_config: dict[str, Any]) -> bool:
    nested = base_config.get("text_config")
    if isinstance(nested, dict) and "tie_word_embeddings" in nested:
        return bool(nested["tie_word_embeddings"])
    return bool(base_config.get("tie_word_embeddings", False))


class _Geometry:
    """The in/out features of each adaptable module of the base model, with their reasons."""

    def __init__(self, base_config: dict[str, Any]) -> None:
        config = text_config_of(base_config)
        self.nested = isinstance(base_config.get("text_config"), dict)
        self.name = str(base_config.get("_name_or_path") or base_config.get("model_type") or "")

        def value(key: str, default: Any = None) -> int:
            found = config.get(key, default)
            if found is None:
                raise AdapterRejected(
                    f"the base model's config.json has no {key}; cannot check the adapter against it"
                )
            return int(found)

        self.hidden = value("hidden_size")
        self.heads = value("num_attention_heads")
        self.kv_heads = value("num_key_value_heads", self.heads)
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.intermediate = value("intermediate_size")
        self.vocab = value("vocab_size")
        self.layers = value("num_hidden_layers")
        moe = config.get("moe_intermediate_size")
        self.expert_intermediate = int(moe) if moe else self.intermediate
        experts = next(
            (
                config[k]
                for k in ("num_experts", "num_local_experts", "n_routed_experts")
                if config.get(k)
            ),
            None,
        )
        self.experts = int(experts) if experts else 0

    def features(self, parsed: LoraKey) -> tuple[tuple[int, str], tuple[int, str]]:
        """((in_features, why), (out_features, why)) of the module ``parsed`` adapts."""
        hidden = (self.hidden, "base model hidden_size")
        q_out = (
            self.heads * self.head_dim,
            f"num_attention_heads {self.heads} x head_dim {self.head_dim}",
        )
        kv_out = (
            self.kv_heads * self.head_dim,
            f"num_key_value_heads {self.kv_heads} x head_dim {self.head_dim}",
        )
        if parsed.expert is not None:
            inter = (self.expert_intermediate, "base model expert intermediate size")
        else:
            inter = (self.intermediate, "base model intermediate_size")
        vocab = (self.vocab, "base model vocab_size")
        table = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
            "lm_head": (hidden, vocab),
        }
        if parsed.kind == "embed_tokens":
            # An embedding LoRA maps token ids (vocab) to hidden; a plain lora_A/B pair on
            # embed_tokens comes from a tied unembedding (Tinker) and maps hidden to vocab.
            if parsed.part.startswith("embedding_"):
                return vocab, hidden
            return hidden, vocab
        return table[parsed.kind]


def validate_adapter(
    peft_dir: Path, base_config: dict[str, Any], max_lora_rank: int
) -> AdapterFacts:
    """Check the PEFT adapter in ``peft_dir`` against the base model and the engine's rank limit.

    Returns what the gateway reports about the adapter; raises ``AdapterRejected`` with a
    reason the user can act on when vLLM would refuse the adapter or misapply it.
    """
    config = _read_config(peft_dir)
    _check_config(config)
    header = _read_weights(peft_dir)
    geometry = _Geometry(base_config)
    parsed = [parse_lora_key(name) for name in header.tensors]
    if not parsed:
        raise AdapterRejected(f"{peft_dir / WEIGHTS_FILENAME} holds no tensors")
    _check_prefixes(parsed, geometry)
    ranks = _check_tensors(parsed, header.tensors, geometry)
    rank = max([*ranks.values(), *_pattern_ranks(config)])
    _check_rank(rank, max_lora_rank)
    size = header.file_size + (peft_dir / CONFIG_FILENAME).stat().st_size
    return AdapterFacts(
        rank=rank,
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted({p.kind for p in parsed})),
        size_bytes=size,
        num_tensors=len(parsed),
    )


def _read_config(peft_dir: Path) -> dict[str, Any]:
    path = peft_dir / CONFIG_FILENAME
    if not peft_dir.is_dir():
        raise AdapterRejected(f"{peft_dir} is not a directory")
    if not path.is_file():
        raise AdapterRejected(
            f"{peft_dir} has no {CONFIG_FILENAME}: it is not a PEFT adapter; {CONVERT_HINT}"
        )
    return read_json_object(path, AdapterRejected, "; fix or re-export it")


def _check_config(config: dict[str, Any]) -> None:
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterRejected(f"adapter peft_type is {peft_type}; vLLM serves only LORA adapters")
    if config.get("use_dora"):
        raise AdapterRejected(
            "adapter uses DoRA (use_dora: true), which vLLM cannot serve; retrain it as a "
            "plain LoRA or merge it into the base model"
        )
    if config.get("modules_to_save"):
        raise AdapterRejected(
            f"adapter fully trains modules_to_save {config['modules_to_save']}, which vLLM cannot "
            "serve as a LoRA; retrain without modules_to_save or merge it into the base model"
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterRejected(
            f"adapter trains biases (bias: {bias!r}), which vLLM cannot serve; retrain with "
            "bias='none'"
        )
    for field in ("r", "lora_alpha", "target_modules"):
        if config.get(field) in (None, "", []):
            raise AdapterRejected(f"adapter_config.json has no {field}; {CONVERT_HINT}")
    if not isinstance(config["r"], int) or isinstance(config["r"], bool) or config["r"] < 1:
        raise AdapterRejected(
            f"adapter_config.json r must be a positive integer, got {_shown(config['r'])}"
        )
    _check_alpha("lora_alpha", config["lora_alpha"])
    for field, check in (("rank_pattern", _check_rank_value), ("alpha_pattern", _check_alpha)):
        pattern = config.get(field)
        if pattern in (None, {}):
            continue
        if not isinstance(pattern, dict):
            raise AdapterRejected(
                f"adapter_config.json {field} must map module names to numbers, got "
                f"{_shown(pattern)}"
            )
        for module, value in pattern.items():
            check(f"{field}[{module!r}]", value)


def _shown(value: Any) -> str:
    """``value`` as a message shows it: cut short past 40 characters (a 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _check_alpha(field: str, value: Any) -> None:
    # NaN or Infinity, which JSON as Python reads it takes: vLLM would scale every weight by them.
    if not is_finite_number(value) or value <= 0:
        raise AdapterRejected(
            f"adapter_config.json {field} must be a finite number above 0, got {_shown(value)}"
        )


def _check_rank_value(field: str, value: Any) -> None:
    if not is_finite_number(value) or not float(value).is_integer() or value < 1:
        raise AdapterRejected(
            f"adapter_config.json {field} must be a positive whole number, got {_shown(value)}"
        )


def _read_weights(peft_dir: Path) -> Any:
    path = peft_dir / WEIGHTS_FILENAME
    if not path.is_file():
        others = sorted(p.name for p in peft_dir.glob("adapter_model.*"))
        found = f" (found {', '.join(others)})" if others else ""
        raise AdapterRejected(f"{peft_dir} has no {WEIGHTS_FILENAME}{found}; {CONVERT_HINT}")
    try:
        return read_safetensors_header(path)
    except SafetensorsError as exc:
        raise AdapterRejected(str(exc)) from exc


def _check_prefixes(parsed: list[LoraKey], geometry: _Geometry) -> None:
    prefixes = {p.prefix for p in parsed if p.prefix is not None}
    allowed = NESTED_TEXT_PREFIXES if geometry.nested else TEXT_ONLY_PREFIXES
    wrong = sorted(prefixes - set(allowed))
    if wrong:
        trained_for = "a text-only model" if wrong == ["model"] else "a vision-language model"
        base_is = "a vision-language model" if geometry.nested else "a text-only model"
        raise AdapterRejected(
            f"adapter modules live under {wrong[0]!r}: it was trained for {trained_for}, but the "
            f"base model is {base_is} whose decoder layers live under {' or '.join(map(repr, allowed))}"
        )


def _check_tensors(
    parsed: list[LoraKey], tensors: dict[str, Any], geometry: _Geometry
) -> dict[str, int]:
    """Check every tensor's shape; returns the rank of each module."""
    modules: dict[str, dict[str, LoraKey]] = {}
    for item in parsed:
        info = tensors[item.key]
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterRejected(
                f"tensor {item.key!r} has dtype {info.dtype}; vLLM needs LoRA weights in "
                f"{', '.join(FLOAT_DTYPES)} (quantized LoRA weights cannot be served)"
            )
        if len(info.shape) != 2:
            raise AdapterRejected(
                f"tensor {item.key!r} has shape {list(info.shape)}; a LoRA weight is a matrix. "
                f"3-D expert tensors (Tinker MoE layout): {CONVERT_HINT}"
            )
        if item.layer is not None and item.layer >= geometry.layers:
            raise AdapterRejected(
                f"tensor {item.key!r} is for layer {item.layer} but the base model has "
                f"{geometry.layers} layers (num_hidden_layers); the adapter was trained for a "
                "different model"
            )
        if item.expert is not None and item.expert >= geometry.experts:
            raise AdapterRejected(
                f"tensor {item.key!r} is for expert {item.expert} but the base model has "
                f"{geometry.experts} experts; the adapter was trained for a different model"
            )
        modules.setdefault(item.module, {})[item.part.removeprefix("embedding_")] = item
    ranks: dict[str, int] = {}
    for module, parts in modules.items():
        if set(parts) != {"A", "B"}:
            missing = "B" if "A" in parts else "A"
            raise AdapterRejected(
                f"module {module!r} has no lora_{missing} weight; the adapter is incomplete"
            )
        ranks[module] = _check_module(parts["A"], parts["B"], tensors, geometry)
    return ranks


def _check_module(a: LoraKey, b: LoraKey, tensors: dict[str, Any], geometry: _Geometry) -> int:
    a_shape, b_shape = tensors[a.key].shape, tensors[b.key].shape
    (in_features, in_why), (out_features, out_why) = geometry.features(a)
    rank = a_shape[0]
    if a_shape[1] != in_features:
        raise AdapterRejected(
            f"{a.module}: {a.kind} expects in_features {in_features} ({in_why}) but the adapter "
            f"has {a_shape[1]}; the adapter was trained for a different model"
        )
    if b_shape[0] != out_features:
        raise AdapterRejected(
            f"{b.module}: {b.kind} expects out_features {out_features} ({out_why}) but the "
            f"adapter has {b_shape[0]}; the adapter was trained for a different model"
        )
    if b_shape[1] != rank:
        raise AdapterRejected(
            f"{a.module}: lora_A has rank {rank} but lora_B has rank {b_shape[1]}; the adapter is corrupt"
        )
    if rank < 1:
        raise AdapterRejected(f"{a.module}: rank 0 LoRA weights; the adapter is empty")
    return int(rank)


def _pattern_ranks(config: dict[str, Any]) -> list[int]:
    # Checked by _check_config: every value is a positive whole number.
    pattern = config.get("rank_pattern") or {}
    return [int(config["r"]), *(int(v) for v in pattern.values())]


def smallest_max_lora_rank(rank: int) -> int | None:
    """The smallest valid ``--max-lora-rank`` that fits ``rank``, or None if none does."""
    return next((value for value in VALID_MAX_LORA_RANKS if value >= rank), None)


def _check_rank(rank: int, max_lora_rank: int) -> None:
    if rank <= max_lora_rank:
        return
    valid = ", ".join(map(str, VALID_MAX_LORA_RANKS))
    fit = smallest_max_lora_rank(rank)
    if fit is None:
        raise AdapterRejected(
            f"adapter rank {_shown(rank)} is above {VALID_MAX_LORA_RANKS[-1]}, the largest "
            f"--max-lora-rank vLLM accepts (valid values: {valid}); it cannot be served"
        )
    raise AdapterRejected(
        f"adapter rank {rank} is above the engine's --max-lora-rank {max_lora_rank}; restart the "
        f"gateway with --max-lora-rank {fit} or higher (valid values: {valid})"
    )
