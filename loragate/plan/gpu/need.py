"""What one engine needs of each GPU it runs on, as vLLM will count it: weights in the served
dtype, the KV cache of one ``max_model_len`` sequence (or the ``--kv-cache-memory-bytes`` it is
given), activations, LoRA slots and CUDA graphs inside its ``--gpu-memory-utilization`` share,
and its CUDA context outside it (``vllm_rules`` has the rules and their sources).

Read from the model's ``config.json`` and safetensors headers and the engine's flags alone:
nothing is loaded, no GPU is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loragate.engine_flags import ParallelLayout, engine_arg_value
from loragate.plan.gpu.vllm_rules import (
    BLOCK_TOKENS,
    DRIVER_RESERVE_FRACTION,
    LOGIT_BYTES,
    ONLINE_FP8,
    RUNTIME_BYTES,
    EngineRules,
    checkpoint_method,
    default_batch,
    in_flight_tokens,
    one_sequence_kv_bytes,
    pool_block_bytes,
)
from loragate.plan.preflight.kv_layers import KvLayers, kv_layers
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.memory import MemoryPlan, memory_plan, parse_bytes, size
from loragate.plan.preflight.model_files import (
    ONLINE_QUANTIZATION,
    ModelShape,
    derived_max_len,
    model_shape,
    quantization_settings,
    read_json,
)

# Shares are planned in thousandths of a GPU: vLLM takes any fraction, and a hundredth of a
# 141 GiB card is 1.4 GiB.
STEP = 1000
# The shortest --max-model-len worth suggesting, and the rounding of a suggested one.
SHORTEST_LEN = 256


@dataclass(frozen=True)
class EngineAsk:
    """One engine to plan: its name, model directory and flags. ``model_dir`` None is a model
    that cannot be planned (``unknown`` says why); ``devices`` are the GPUs a catalog entry
    pins it to (positions in the GPU list)."""

    name: str
    model_dir: Path | None
    engine_args: tuple[str, ...] = ()
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    lora_slots: int = 2  # --max-loras: LoRA weights vLLM keeps on the GPU
    lora_rank: int = 16  # --max-lora-rank
    devices: tuple[int, ...] | None = None
    unknown: str | None = None
    keep: bool = False
    preload: bool = False
    flags_at: str = "after --"  # where its engine flags go, for a refusal to say

    def with_args(self, *extra: str) -> EngineAsk:
        return replace(self, engine_args=(*self.engine_args, *extra))

    @property
    def gpu_count(self) -> int:
        return max(self.layout.local_workers, 1)


@dataclass(frozen=True)
class EngineNeed:
    """What an engine needs of each of its GPUs; ``*_on(gpu)`` where the GPU's size matters
    (vLLM's default batch, and so its activations and what a sliding window keeps, grows
    with the card)."""

    ask: EngineAsk
    memory: MemoryPlan
    shape: ModelShape | None  # None: no config.json to read it from (the KV cache unknown)
    layers: KvLayers | str  # its KV layers on one GPU, or why they cannot be told
    layer_token_bytes: int  # bytes one token's keys and values take in one layer, one GPU
    max_model_len: int  # what vLLM will serve: --max-model-len, else the config's
    model_len: int  # the config's own longest sequence (vLLM's ceiling without overrides)
    auto_len: bool  # --max-model-len -1 or auto: vLLM fits it to the memory
    kv_given: int | None  # --kv-cache-memory-bytes (per GPU)
    share_given: float | None  # --gpu-memory-utilization
    lora_bytes: int
    batch_given: tuple[int | None, int | None]  # --max-num-batched-tokens, --max-num-seqs

    @property
    def weights_per_gpu(self) -> int:
        return self.memory.weights_per_gpu

    @property
    def kv_known(self) -> bool:
        """Whether the plan can size the KV cache at all."""
        return self.shape is not None and isinstance(self.layers, KvLayers)

    def batch_on(self, gpu: GpuInfo) -> tuple[int, int]:
        """vLLM's --max-num-batched-tokens and --max-num-seqs on ``gpu``."""
        tokens, seqs = default_batch(gpu.total_bytes, gpu.name)
        return self.batch_given[0] or tokens, self.batch_given[1] or seqs

    def kv_for(self, tokens: int, gpu: GpuInfo) -> int:
        """What one sequence of ``tokens`` takes of the KV cache on ``gpu``, as vLLM counts
        it: whole blocks, each sliding-window layer only its window and the tokens in flight;
        0 when it cannot be told."""
        if not isinstance(self.layers, KvLayers) or self.shape is None:
            return 0
        in_flight = in_flight_tokens(self.batch_on(gpu)[0], self.ask.layout.pipeline)
        return one_sequence_kv_bytes(self.layers, self.layer_token_bytes, tokens, in_flight)

    def one_sequence_on(self, gpu: GpuInfo) -> int:
        return self.kv_for(BLOCK_TOKENS if self.auto_len else self.max_model_len, gpu)

    def activation_on(self, gpu: GpuInfo) -> int:
        """Peak activations of vLLM's memory profile: the largest batch through a layer (the
        MLP's gate and up outputs and a few hidden-size buffers, in 16 bits) and the sampler's
        float32 logits and probabilities for every sequence of a batch."""
        if self.shape is None:
            return 0
        tokens, seqs = self.batch_on(gpu)
        forward = tokens * (2 * self.shape.intermediate + 4 * self.shape.hidden) * 2
        sampler = seqs * self.shape.vocab * LOGIT_BYTES * 2
        return forward + sampler

    def fixed_on(self, gpu: GpuInfo) -> int:
        """Everything inside the share but the KV cache."""
        return self.weights_per_gpu + self.activation_on(gpu) + self.lora_bytes + RUNTIME_BYTES

    def sequence_need_on(self, gpu: GpuInfo) -> int:
        """The KV cache vLLM must have: one whole sequence and the block its pool keeps back."""
        return self.one_sequence_on(gpu) + self._null_block()

    def kv_need(self, gpu: GpuInfo) -> int:
        """The KV cache the share must hold: the sequence's need, or the
        --kv-cache-memory-bytes given (which must hold it)."""
        return self.kv_given if self.kv_given is not None else self.sequence_need_on(gpu)

    def need_on(self, gpu: GpuInfo) -> int:
        """Bytes the share must hold on ``gpu``: what vLLM checks before it serves."""
        return self.fixed_on(gpu) + self.kv_need(gpu)

    def least_share_on(self, gpu: GpuInfo) -> int:
        """The smallest share (thousandths) that holds the need, against the total vLLM sees."""
        usable = gpu.total_bytes * (1 - DRIVER_RESERVE_FRACTION)
        return math.ceil(self.need_on(gpu) * STEP / max(usable, 1))

    def kv_in_share(self, gpu: GpuInfo, share: int) -> int:
        """The KV cache vLLM sizes in ``share`` (thousandths) of ``gpu``."""
        if self.kv_given is not None:
            return self.kv_given
        usable = gpu.total_bytes * (1 - DRIVER_RESERVE_FRACTION)
        return max(0, int(usable * share / STEP) - self.fixed_on(gpu))

    def longest_len(self, kv_bytes: int, gpu: GpuInfo) -> int:
        """The longest --max-model-len whose one sequence fits in ``kv_bytes`` on ``gpu`` (the
        pool's held-back block aside), in whole blocks, at most the model's own length (or
        the one given, when longer); vLLM's own search (kv_cache_utils.py:2368-2400)."""
        ceiling = max(self.model_len, self.max_model_len) // BLOCK_TOKENS
        room = kv_bytes - self._null_block()
        if not self.kv_known or self.kv_for(BLOCK_TOKENS, gpu) > room:
            return 0
        low, high = 1, max(ceiling, 1)
        while low < high:  # the most blocks that fit: kv_for grows with the length
            middle = (low + high + 1) // 2
            if self.kv_for(middle * BLOCK_TOKENS, gpu) <= room:
                low = middle
            else:
                high = middle - 1
        return min(low * BLOCK_TOKENS, max(self.model_len, self.max_model_len))

    def describe_need(self, gpu: GpuInfo) -> str:
        """What the need on ``gpu`` is made of, in words."""
        if self.kv_given is not None:
            kv = f"{size(self.kv_given)} of KV cache (--kv-cache-memory-bytes)"
        elif self.shape is None:
            kv = "a KV cache it cannot size (no config.json with the layers and heads)"
        elif isinstance(self.layers, str):
            kv = f"a KV cache it cannot size ({self.layers.removeprefix('cannot tell: ')})"
        else:
            tokens = self.max_model_len if not self.auto_len else BLOCK_TOKENS
            kv = f"{size(self.one_sequence_on(gpu))} of KV cache for one {tokens}-token sequence"
            if self.layers.sliding or self.layers.state:
                kv += f" ({self.layers.describe()})"
        rest = self.activation_on(gpu) + self.lora_bytes + RUNTIME_BYTES
        weights = self.memory.describe_weights()
        if self.memory.split > 1:
            weights = f"its part ({size(self.weights_per_gpu)}) of {weights}"
        return f"{weights}, {kv}, and {size(rest)} for activations, LoRA slots and CUDA graphs"

    def _null_block(self) -> int:
        if not isinstance(self.layers, KvLayers):
            return 0
        return pool_block_bytes(self.layers, self.layer_token_bytes)


def suggested_len(tokens: int) -> int:
    """A --max-model-len to suggest for ``tokens`` that fit: a multiple of 256 below them."""
    return tokens // SHORTEST_LEN * SHORTEST_LEN


def engine_need(ask: EngineAsk, rules: EngineRules) -> EngineNeed | str:
    """The need of ``ask``'s engine, or why vLLM would refuse it whatever the GPU (a
    quantization it does not take), or why it cannot be told (the reason starts with
    ``cannot tell``)."""
    if ask.model_dir is None:
        return ask.unknown or "cannot tell: the model is not on this machine"
    args = list(ask.engine_args)
    config = read_json(ask.model_dir / "config.json")
    refused = quantization_refusal(config, args, rules)
    if refused is not None:
        return refused
    plan = memory_plan(ask.model_dir, args, layout=ask.layout)
    if plan is None:
        return (
            f"cannot tell how much memory {ask.name} needs: {ask.model_dir} has no weights to "
            "size and no config.json to count them from, or a --quantization of unknown width"
        )
    shape = model_shape(config)
    kv_dtype = engine_arg_value(args, "--kv-cache-dtype")
    kv_width = 1 if kv_dtype and kv_dtype.startswith("fp8") else plan.dtype_bytes
    per_token = shape.kv_elements_per_layer_token(ask.layout.tensor) * kv_width if shape else 0
    # vLLM's hybrid KV cache manager is on unless turned off (config/vllm.py:2136-2207).
    hybrid = "--disable-hybrid-kv-cache-manager" not in args
    layers = kv_layers(config, hybrid_manager=hybrid)
    pooling = _is_pooling(config, args)
    model_len = derived_max_len(
        config, read_json(ask.model_dir / "tokenizer_config.json"), pooling=pooling
    )
    if "--disable-sliding-window" in args:
        # vLLM caps the length at the window and drops it (config/model.py:2542-2550).
        window = _text_window(config)
        model_len = min(model_len, window) if window else model_len
        layers = kv_layers(config, hybrid_manager=False)
    given = engine_arg_value(args, "--max-model-len")
    length = _parse_len(given)
    auto = given is not None and given.strip().lower() in ("-1", "auto")
    rank = ask.lora_rank * ask.lora_slots * (shape.layers * shape.linear_in_out if shape else 0)
    return EngineNeed(
        ask=ask,
        memory=plan,
        shape=shape,
        layers=layers.on_stage(ask.layout.pipeline) if isinstance(layers, KvLayers) else layers,
        layer_token_bytes=per_token,
        max_model_len=length if length and length > 0 else model_len,
        model_len=model_len,
        auto_len=auto,
        kv_given=parse_bytes(engine_arg_value(args, "--kv-cache-memory-bytes")),
        share_given=_share(engine_arg_value(args, "--gpu-memory-utilization")),
        lora_bytes=math.ceil(rank * plan.dtype_bytes / max(ask.layout.tensor, 1)),
        batch_given=(
            _parse_len(engine_arg_value(args, "--max-num-batched-tokens")),
            _parse_len(engine_arg_value(args, "--max-num-seqs")),
        ),
    )


def quantization_refusal(
    config: dict[str, Any], engine_args: Sequence[str], rules: EngineRules
) -> str | None:
    """Why the installed vLLM refuses this quantization, naming what it takes instead; or why
    the plan cannot tell (a sentence starting ``cannot tell``). The checkpoint's method is
    read as vLLM rewrites it (``vllm_rules.checkpoint_method``)."""
    flagged = engine_arg_value(list(engine_args), "--quantization", ("-q",))
    settings = quantization_settings(config)
    stored = str((settings or {}).get("quant_method") or "")
    method = checkpoint_method(settings, rules) if settings is not None else None
    if settings is not None and method is None and (stored or settings.get("producer")):
        return (
            f"cannot tell whether {rules.describe()} takes the checkpoint's quantization "
            f"({stored or 'a ModelOpt algorithm'})"
        )
    if method is not None and method not in rules.quantization:
        if stored in rules.override_names or method in rules.override_names:
            return (
                f"cannot tell: the checkpoint is quantized with {stored}, which "
                f"{rules.describe()} does not list but may take under another name (its "
                "quantization methods' override_quantization_method)"
            )
        return (
            f"the checkpoint is quantized with {stored or method}, which {rules.describe()} does "
            f"not take (it takes {', '.join(rules.quantization)}): pick a checkpoint quantized "
            "with one of those, or its float original"
        )
    if flagged is None:
        return None
    if flagged not in rules.quantization:
        return (
            f"--quantization {flagged}: {rules.describe()} does not take it; it takes "
            f"{', '.join(rules.quantization)}"
        )
    if method is not None and flagged != method and flagged in ONLINE_QUANTIZATION:
        return (
            f"--quantization {flagged}: the checkpoint is already quantized with {method}, and "
            f"vLLM refuses a --quantization other than the checkpoint's own: drop the flag"
        )
    if flagged in rules.deprecated and "--allow-deprecated-quantization" not in engine_args:
        return (
            f"--quantization {flagged} is deprecated in {rules.describe()}, which refuses it "
            "unless --allow-deprecated-quantization is given"
        )
    return None


def online_fp8(rules: EngineRules) -> str | None:
    """The online fp8 method to suggest, in the installed vLLM's spelling."""
    for name in (ONLINE_FP8, "fp8"):
        if name in rules.quantization and name not in rules.deprecated:
            return name
    return None


def without_quantization(ask: EngineAsk) -> EngineAsk:
    """``ask`` without its --quantization flag (either spelling, with its value)."""
    kept: list[str] = []
    skip = False
    for arg in ask.engine_args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--quantization", "-q"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    return replace(ask, engine_args=tuple(kept))


# Architectures vLLM runs as generative models; a checkpoint with others (BertModel, ...
# ForSequenceClassification) runs as a pooling model (config/model.py's runner "auto").
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def _is_pooling(config: dict[str, Any], args: Sequence[str]) -> bool:
    """Whether vLLM runs the model as a pooling model: ``--runner pooling``, a ``--convert``
    to one, or (``--runner auto``) no generative architecture."""
    runner = engine_arg_value(list(args), "--runner")
    if runner in ("pooling", "generate"):
        return runner == "pooling"
    if engine_arg_value(list(args), "--convert") in ("embed", "classify"):
        return True
    names = [str(name) for name in config.get("architectures") or []]
    return bool(names) and not any(name.endswith(_GENERATIVE) for name in names)


def _text_window(config: dict[str, Any]) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("sliding_window") if isinstance(text, dict) else None
    return value if isinstance(value, int) and value > 0 else None


def _parse_len(value: str | None) -> int | None:
    """A length as vLLM's ``human_readable_int`` reads it (``8192``, ``8k`` = 8000, ``8K`` =
    8192: utils/argparse_utils.py:29); None when absent, -1 for ``auto``."""
    if value is None:
        return None
    text = value.strip()
    if text.lower() == "auto":
        return -1
    scale = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text[-1:] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        return None


def _share(value: str | None) -> float | None:
    try:
        share = float(value) if value is not None else None
    except ValueError:
        return None
    return share if share is not None and 0 < share <= 1 else None
