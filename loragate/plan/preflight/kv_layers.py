"""Which of a decoder's layers keep a KV cache, and for how many tokens, read from its
``config.json`` as vLLM sees the model: through transformers' config class, which fills in
what the file leaves out (``layer_types`` from a pattern, a default window), and vLLM's model
code, which gives a layer a window when its ``layer_types`` entry says ``sliding_attention``.

- **Full attention** (``full_attention``, ``attention``, sparse attention that still caches
  every token, MLA): every token of the sequence.
- **Sliding window** (``sliding_attention``): only the last ``sliding_window`` tokens, once
  vLLM's hybrid KV cache manager is on (its default on GPUs); with it off (the CPU build,
  ``--disable-hybrid-kv-cache-manager``, chunked local attention) vLLM counts them as full
  attention (``v1/core/kv_cache_utils.py`` ``unify_hybrid_kv_cache_specs``).
- **Recurrent state** (Mamba, linear attention, short convolutions): a fixed state per
  sequence, whatever its length; no KV cache per token.

A model without ``layer_types`` in its ``config.json`` gets the pattern its transformers config
class computes (Gemma 2 and 3, Cohere 2, gpt-oss, OLMo 3; Jamba, Qwen3-Next, Nemotron-H and
Bamba for their attention layers); one with a ``sliding_window`` and no pattern gets the window
on every layer (vLLM 0.32 ``engine/arg_utils.py:2250-2254``) when its family is known to mean
that (Mistral, Phi-3, Starcoder 2). Anything else that says it has windows or a state is a
reason the plan cannot tell, rather than a guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FULL_KINDS = frozenset(
    {"full_attention", "attention", "indexed_attention", "deepseek_sparse_attention",
     "qwen_sparse_attention"}
)  # fmt: skip
SLIDING_KINDS = frozenset({"sliding_attention"})
STATE_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "conv"})
# Layers with neither attention nor state (Nemotron-H's MLP and MoE layers).
NOTHING_KINDS = frozenset({"mlp", "moe"})

# transformers' defaults where a family's config.json may leave the window out.
_DEFAULT_WINDOW = {
    "gemma2": 4096, "gemma3_text": 4096, "cohere2": 4096, "gpt_oss": 128, "olmo3": 4096,
    "mistral": 4096,
}  # fmt: skip
# Families whose config class turns ``sliding_window`` into a window on every layer.
_ALL_SLIDING = frozenset({"mistral", "mixtral", "phi3", "phimoe", "starcoder2", "ministral"})
# Families whose config class drops the window unless ``use_sliding_window`` is true.
_OPT_IN_WINDOW = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_5_vl"})
# Keys that say a model has recurrent layers, whatever it calls them.
_STATE_KEYS = (
    "mamba_d_state", "mamba_expand", "ssm_state_size", "mamba_n_heads", "linear_conv_kernel_dim",
    "linear_num_value_heads", "attn_layer_period", "hybrid_override_pattern",
)  # fmt: skip


@dataclass(frozen=True)
class KvLayers:
    """How many layers keep a KV cache of each kind (on one pipeline stage, once split)."""

    full: int
    sliding: int = 0
    window: int = 0  # tokens a sliding layer attends to
    state: int = 0  # layers holding a recurrent state instead of a KV cache

    @property
    def attention(self) -> int:
        return self.full + self.sliding

    def on_stage(self, pipeline: int) -> KvLayers:
        """The layers one pipeline stage holds (the stages split them evenly)."""
        stages = max(pipeline, 1)
        return KvLayers(
            math.ceil(self.full / stages),
            math.ceil(self.sliding / stages),
            self.window,
            math.ceil(self.state / stages),
        )

    def describe(self) -> str:
        """``5 full-attention layers, 29 sliding-window layers of 1024 tokens``."""
        parts = [f"{self.full} full-attention layers"] if self.full or not self.sliding else []
        if self.sliding:
            parts.append(f"{self.sliding} sliding-window layers of {self.window} tokens")
        said = ", ".join(parts)
        if self.state:
            said += f"; the state of {self.state} Mamba or linear-attention layers not counted"
        return said


def kv_layers(config: dict[str, Any], *, hybrid_manager: bool = True) -> KvLayers | str:
    """The model's KV layers, or why they cannot be told (a sentence starting ``cannot
    tell``). ``hybrid_manager`` False: vLLM's hybrid KV cache manager is off, and it counts
    sliding-window layers as full attention."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    try:
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return "cannot tell: config.json names no num_hidden_layers"
    family = str(text.get("model_type") or config.get("model_type") or "")
    window = _window(text, family)
    if isinstance(window, str):
        return window
    kinds = _kinds(text, family, layers, window)
    if isinstance(kinds, str):
        return kinds
    unknown = sorted(set(kinds) - FULL_KINDS - SLIDING_KINDS - STATE_KINDS - NOTHING_KINDS)
    if unknown:
        return f"cannot tell: layer kind {unknown[0]!r} in config.json is not one the plan sizes"
    full = sum(kind in FULL_KINDS for kind in kinds)
    sliding = sum(kind in SLIDING_KINDS for kind in kinds)
    state = sum(kind in STATE_KINDS for kind in kinds)
    if family == "falcon_h1":  # each layer runs attention and Mamba side by side
        state = layers
    if sliding and window is None:
        return "cannot tell: config.json has sliding-window layers but no sliding_window"
    if int(text.get("num_kv_shared_layers") or 0):
        return "cannot tell: some layers share another layer's KV cache (num_kv_shared_layers)"
    if not hybrid_manager or text.get("attention_chunk_size"):
        # Chunked local attention (Llama 4) turns the hybrid manager off too
        # (config/vllm.py:2148-2168).
        return KvLayers(full + sliding, 0, 0, state)
    return KvLayers(full, sliding, (window or 0) if sliding else 0, state)


def _window(text: dict[str, Any], family: str) -> int | str | None:
    """The sliding window in tokens; None without one."""
    if family in _OPT_IN_WINDOW and not text.get("use_sliding_window"):
        return None
    value = text.get("sliding_window", _DEFAULT_WINDOW.get(family))
    if value is None or value is False or value == 0:
        return None  # vLLM reads 0 as no window (config/model.py:802-808)
    if isinstance(value, int) and value > 0:
        return value
    return f"cannot tell: config.json's sliding_window {value!r} is not a number of tokens"


def _kinds(text: dict[str, Any], family: str, layers: int, window: int | None) -> list[str] | str:
    """Each layer's kind, as transformers' config class (and vLLM's model) sees it."""
    listed = text.get("layer_types") or text.get("layers_block_type")
    if isinstance(listed, list) and len(listed) >= layers:
        return [str(kind) for kind in listed[:layers]]
    if listed is not None:
        return "cannot tell: config.json's layer_types does not name every layer"
    patterns = {
        "gemma2": 2,
        "gemma3_text": int(text.get("sliding_window_pattern") or 6),
        "gemma3": int(text.get("sliding_window_pattern") or 6),
        "cohere2": int(text.get("sliding_window_pattern") or 4),
        "gpt_oss": 2,
        "olmo3": 4,
    }
    if family in patterns:  # every pattern-th layer is global, the others slide
        every = max(patterns[family], 1)
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(layers)]  # fmt: skip
    hybrid = _hybrid_kinds(text, family, layers)
    if hybrid is not None:
        return hybrid
    if any(key in text for key in _STATE_KEYS) or "mamba" in family:
        return f"cannot tell: {family or 'the model'} has recurrent layers the plan cannot place"
    if window is None:
        return ["full_attention"] * layers
    if family in _ALL_SLIDING:
        return ["sliding_attention"] * layers
    return (
        f"cannot tell: config.json has a sliding_window but no layer_types, and which layers "
        f"of a {family or 'model of unknown type'} slide is not known to the plan"
    )


def _hybrid_kinds(text: dict[str, Any], family: str, layers: int) -> list[str] | None:
    """The attention and state layers of hybrid families whose config.json gives a rule, not
    a list (their transformers config classes)."""
    if family == "jamba":
        period = int(text.get("attn_layer_period") or 8)
        offset = int(text.get("attn_layer_offset") or 4)
        return ["attention" if i % period == offset else "mamba" for i in range(layers)]
    if family == "qwen3_next":
        every = int(text.get("full_attention_interval") or 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(layers)]  # fmt: skip
    if family == "nemotron_h" and isinstance(text.get("hybrid_override_pattern"), str):
        letters = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        pattern = text["hybrid_override_pattern"]
        return [letters.get(letter, letter) for letter in pattern[:layers]]
    if family == "bamba" and isinstance(text.get("attn_layer_indices"), list):
        attention = set(text["attn_layer_indices"])
        return ["attention" if i in attention else "mamba" for i in range(layers)]
    if family == "falcon_h1":
        return ["attention"] * layers
    attn_types = text.get("attn_type_list")  # MiniMax: 1 is softmax attention, 0 linear
    if isinstance(attn_types, list) and len(attn_types) >= layers:
        return ["attention" if kind == 1 else "linear_attention" for kind in attn_types[:layers]]
    return None
