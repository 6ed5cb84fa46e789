"""What vLLM demands of a GPU before it serves, as its source says; the lists that change
between releases are read from the installed vLLM's files (never imported: the gateway stays
light), with vLLM 0.32's as the fallback.

The rules (file:line in vLLM 0.32's installed package):

- **The start-up share check.** Each worker sets its device and starts the distributed
  environment (``v1/worker/gpu_worker.py:501-515``), then snapshots free memory
  (``gpu_worker.py:534``) and calls ``request_memory`` (``v1/worker/utils.py:716``), which
  raises "Free memory on device ... is less than desired GPU memory utilization"
  (``utils.py:761-770``) whenever free memory is below ``gpu_memory_utilization x total``.
  Nothing skips it: ``--kv-cache-memory-bytes`` only changes how the KV cache is sized later
  (``gpu_worker.py:649-676``). The CUDA context is spent before the snapshot, so it is outside
  the share: an engine holds its context plus its share. The total is torch's
  (``mem_get_info``), which leaves out what the driver reserves; nvidia-smi's counts it. A
  share the plan picks is sized against nvidia-smi's total and a 512 MiB context; one the
  user gives is refused only when it fails even with a 2% reserve and no context
  (``share_verdict``).
- **What the share holds.** The KV cache gets the share less the weights, the profiled peak
  activations, the memory outside torch and the CUDA graphs' estimate
  (``gpu_worker.py:740-744``, ``utils/mem_utils.py:321``).
- **One full sequence.** ``v1/core/kv_cache_utils.py:1003-1040`` raises "To serve at least
  one request with the model's max seq len ..." (for each worker, ``:2639-2648``) unless that
  KV cache, less one block the pool keeps back (the null block, ``:2627-2634``), holds what
  one ``max_model_len`` sequence takes
  (``_max_memory_usage_bytes_from_groups``, ``:2337-2365``): the layers are put in groups of
  equal size (``_get_kv_cache_groups_uniform_page_size``, ``:1362-1500``: the size is the
  smallest count of layers of one kind, or the largest when it is under 1.5 times the
  smallest; a kind's last group is padded), one block is a group's layers' 16 tokens
  (``v1/kv_cache_interface.py:607``, ``config/cache.py:72``), and a sequence takes, per
  group, ``cdiv(max_model_len, 16)`` blocks for full attention
  (``kv_cache_interface.py:602-607``) and ``cdiv(min(window - 1 + in_flight, max_model_len),
  16) + 1`` for a sliding window (``kv_cache_interface.py:859-896``), where ``in_flight`` is
  ``max_num_batched_tokens`` times the batches in flight (2 with async scheduling, vLLM's
  default: ``config/vllm.py:577-597``, ``:1585-1644``). That is with vLLM's hybrid KV cache
  manager, which is on for GPUs, LoRA or not (``config/vllm.py:2136-2207``); off, every
  attention layer counts as full. Mamba and linear-attention layers hold one state per
  sequence (``kv_cache_interface.py:1076-1082``), not a KV cache per token.
- **Quantization names.** ``config/model.py:1451-1456`` refuses a method outside
  ``QuantizationMethods`` (``model_executor/layers/quantization/__init__.py:15``), refuses a
  ``--quantization`` other than the checkpoint's own (``config/model.py:1443-1449``), and one of
  ``DEPRECATED_QUANTIZATION_METHODS`` (``__init__.py:52``) without
  ``--allow-deprecated-quantization`` (``config/model.py:1458-1471``). A checkpoint's
  ``quant_method`` is rewritten first: lower-cased with library names normalised
  (``compressed_tensors`` to ``compressed-tensors``:
  ``transformers_utils/model_arch_config_convertor.py:263-310``, which also names ModelOpt
  checkpoints by their algorithm), then by each method's ``override_quantization_method``
  (``config/model.py:1375-1437``; ``auto-round`` becomes ``inc``:
  ``quantization/inc/inc.py:361-368``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loragate.plan.preflight.kv_layers import KvLayers
from loragate.plan.preflight.machine import ENGINE_PYTHON_TIMEOUT, run_probe

MIB = 1 << 20
GIB = 1 << 30

# The torch CUDA context (and the distributed set-up) each engine process makes on each GPU
# before vLLM's snapshot: outside the share, but gone from what is free.
CUDA_CONTEXT_BYTES = 512 * MIB
# Inside the share beside weights, KV cache, activations and LoRA slots: memory outside
# torch (cuBLAS and attention workspaces) and the CUDA graphs' pools, which vLLM profiles
# and takes from the KV cache (gpu_worker.py:700-744).
RUNTIME_BYTES = 768 * MIB
# nvidia-smi's total counts what the driver reserves; the total vLLM multiplies the share by
# (torch's) does not. Needs are sized against the total less about 1%; a share of the user's
# own is refused only when it cannot start even with a reserve of 2% and no CUDA context
# (an RTX 4090 keeps back about 1.4%, an H100 about 0.7%).
DRIVER_RESERVE_FRACTION = 0.01
DRIVER_RESERVE_MAX_FRACTION = 0.02
# KV cache blocks hold this many tokens (config/cache.py:72, DEFAULT_BLOCK_SIZE).
BLOCK_TOKENS = 16
# The sampler's warm-up holds float32 logits and their probabilities for max_num_seqs rows
# (v1/worker/gpu_model_runner.py:5927 _dummy_sampler_run).
LOGIT_BYTES = 4
# Quantizing as it loads, in vLLM 0.32's spelling (fp8 is its deprecated name on a float
# checkpoint: model_loader/weight_utils.py:351-357).
ONLINE_FP8 = "fp8_per_tensor"

# vLLM 0.32's lists, for when no vLLM can be read (model_executor/layers/quantization/
# __init__.py:15-49 and :52; config/cache.py:102).
QUANTIZATION_METHODS_0_32 = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4",
    "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin",
    "humming", "compressed-tensors", "experts_int8", "quark", "moe_wna16", "torchao", "inc",
    "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor", "fp8_per_block",
    "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8",
)  # fmt: skip
DEPRECATED_QUANTIZATION_0_32 = ("fbgemm_fp8", "fp_quant")
# What vLLM 0.32 rewrites a checkpoint's quant_method with (model_arch_config_convertor.py:299)
# and the names its override_quantization_method functions test for.
RENAMES_0_32 = (("compressed_tensors", "compressed-tensors"),)
OVERRIDE_NAMES_0_32 = (
    "FP4", "FP8", "MIXED_PRECISION", "MXFP8", "NVFP4", "auto-round", "auto_awq", "auto_gptq",
    "awq", "awq_marlin", "gpt_oss_mxfp4", "gptq", "gptq_marlin", "humming", "marlin",
    "modelopt", "modelopt_fp4", "modelopt_mixed", "modelopt_mxfp8", "moe_wna16", "mxfp4",
)  # fmt: skip
# ModelOpt checkpoints are named by their algorithm (model_arch_config_convertor.py:268-290).
_MODELOPT_ALGOS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt",
                   "FP8_PB_WO": "modelopt", "NVFP4": "modelopt_fp4"}  # fmt: skip
DEFAULT_SHARE_0_32 = 0.92

_QUANTIZATION_FILE = "model_executor/layers/quantization/__init__.py"
_CONVERTOR_FILE = "transformers_utils/model_arch_config_convertor.py"
_CACHE_CONFIG_FILE = "config/cache.py"
_VERSION_FILE = "_version.py"
# Where the engine's interpreter would import vLLM from, without importing it.
_FIND_VLLM = (
    "import importlib.util\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "print(spec.origin if spec and spec.origin else '')\n"
)


@dataclass(frozen=True)
class EngineRules:
    """What the installed vLLM accepts, read from its files."""

    quantization: tuple[str, ...]
    deprecated: tuple[str, ...]
    default_share: float  # --gpu-memory-utilization's default
    version: str | None  # e.g. "0.32.0"; None when no vLLM was read
    source: str  # where the lists came from, for a refusal to name
    # (from, to) pairs vLLM replaces in a checkpoint's lower-cased quant_method
    renames: tuple[tuple[str, str], ...] = RENAMES_0_32
    # the strings vLLM's override_quantization_method functions test a checkpoint for
    override_names: tuple[str, ...] = OVERRIDE_NAMES_0_32

    def describe(self) -> str:
        return f"vLLM {self.version}" if self.version else "vLLM 0.32 (loragate's copy)"


FALLBACK_RULES = EngineRules(
    QUANTIZATION_METHODS_0_32,
    DEPRECATED_QUANTIZATION_0_32,
    DEFAULT_SHARE_0_32,
    None,
    "loragate's copy of vLLM 0.32's lists",
)


@functools.cache
def engine_rules(python: str | None = None) -> EngineRules:
    """The rules of the vLLM ``python`` (default: this interpreter) would run, read
    statically from its source; vLLM 0.32's when it has none or its files cannot be read."""
    root = _vllm_dir(python or sys.executable)
    if root is None:
        return FALLBACK_RULES
    tree = _parse(root / _QUANTIZATION_FILE)
    methods = _strings_of(tree, "QuantizationMethods") if tree else None
    if not methods:
        return FALLBACK_RULES
    deprecated = _strings_of(tree, "DEPRECATED_QUANTIZATION_METHODS") if tree else None
    cache = _parse(root / _CACHE_CONFIG_FILE)
    share = _field_default(cache, "gpu_memory_utilization") if cache else None
    version_tree = _parse(root / _VERSION_FILE)
    version = _assigned_string(version_tree, "__version__") if version_tree else None
    convertor = _parse(root / _CONVERTOR_FILE)
    renames = _replace_calls(convertor, "_normalize_quantization_config") if convertor else None
    return EngineRules(
        methods,
        deprecated or (),
        share or DEFAULT_SHARE_0_32,
        version,
        str(root / _QUANTIZATION_FILE),
        renames or RENAMES_0_32,
        _override_names((root / _QUANTIZATION_FILE).parent) or OVERRIDE_NAMES_0_32,
    )


def checkpoint_method(settings: dict[str, Any], rules: EngineRules) -> str | None:
    """The quantization method vLLM reads a checkpoint's ``quantization_config`` as, before
    it checks it against its list; None when vLLM would not know it either (a ModelOpt
    algorithm it has no name for) or the config names none."""
    producer = settings.get("producer")
    modelopt = settings.get("quantization")
    legacy = isinstance(modelopt, dict) and "modelopt_quant_config" in modelopt
    if (isinstance(producer, dict) and producer.get("name") == "modelopt") or legacy:
        algo = modelopt.get("quant_algo") if isinstance(modelopt, dict) else None
        if algo is not None:
            return _MODELOPT_ALGOS.get(str(algo).upper())
    method = str(settings.get("quant_method") or "").lower()
    for old, new in rules.renames:
        method = method.replace(old, new)
    if method == "auto-round" and "inc" in rules.quantization:
        return "inc"  # quantization/inc/inc.py:361-368
    return method or None


def one_sequence_kv_bytes(
    layers: KvLayers, layer_token_bytes: int, tokens: int, in_flight: int
) -> int:
    """What one sequence of ``tokens`` takes of the KV cache, as vLLM counts it before it
    serves (its groups of layers, padding included): see the module's rules."""
    page = BLOCK_TOKENS * layer_token_bytes
    full_blocks = math.ceil(tokens / BLOCK_TOKENS)
    if not layers.sliding:
        return layers.full * page * full_blocks
    kept = min(layers.window - 1 + in_flight, tokens)
    sliding_blocks = math.ceil(kept / BLOCK_TOKENS) + 1
    size = group_size(layers)
    groups_full = math.ceil(layers.full / size)
    groups_sliding = math.ceil(layers.sliding / size)
    return size * page * (groups_full * full_blocks + groups_sliding * sliding_blocks)


def pool_block_bytes(layers: KvLayers, layer_token_bytes: int) -> int:
    """One block of vLLM's KV cache pool: a group's layers' 16 tokens (the pool keeps one
    back, the null block)."""
    return group_size(layers) * BLOCK_TOKENS * layer_token_bytes


def group_size(layers: KvLayers) -> int:
    """The layers in each of vLLM's KV cache groups (kv_cache_utils.py:1466-1478)."""
    counts = [count for count in (layers.full, layers.sliding) if count]
    if not counts:
        return 0
    smallest, largest = min(counts), max(counts)
    return largest if largest < smallest * 1.5 else smallest


def in_flight_tokens(batch_tokens: int, pipeline: int) -> int:
    """Tokens scheduled but not yet settled: ``max_num_batched_tokens`` for each batch in
    flight, two with async scheduling (vLLM's default), one a stage with pipeline
    parallelism on the V1 runner (config/vllm.py:577-597)."""
    return batch_tokens * (2 if pipeline <= 1 else pipeline)


ShareVerdict = Literal["boots", "unsure", "refused"]


def share_verdict(share: float, total: int, free: int) -> ShareVerdict:
    """Whether vLLM's start-up check passes a ``--gpu-memory-utilization`` of ``share`` on a
    GPU nvidia-smi gives ``total`` and ``free`` bytes: it needs share x torch's total (the
    card less the driver's reserve) free after its CUDA context (v1/worker/utils.py:761-770).
    ``refused`` even with the largest reserve and no context; ``boots`` even with no reserve
    and a whole context; ``unsure`` between."""
    if share * total * (1 - DRIVER_RESERVE_MAX_FRACTION) > free:
        return "refused"
    if share * total + CUDA_CONTEXT_BYTES > free:
        return "unsure"
    return "boots"


def default_batch(total_bytes: int, gpu_name: str) -> tuple[int, int]:
    """vLLM's default ``--max-num-batched-tokens`` and ``--max-num-seqs`` for its OpenAI
    server on a GPU this big (engine/arg_utils.py:2923-2952): what its memory profile runs."""
    if total_bytes >= 160 * GIB:
        return 16384, 1024
    if total_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


def _vllm_dir(python: str) -> Path | None:
    if python == sys.executable:
        try:
            spec = importlib.util.find_spec("vllm")  # a top-level name: nothing is imported
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    else:
        done = run_probe([python, "-c", _FIND_VLLM], ENGINE_PYTHON_TIMEOUT)
        origin = done.stdout.strip() if not isinstance(done, str) and done.returncode == 0 else ""
    return Path(origin).parent if origin else None


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, ValueError):
        return None


def _assignments(tree: ast.Module, name: str) -> list[ast.expr]:
    """The values assigned to ``name`` at module level (``NAME = ...`` or ``NAME: T = ...``)."""
    found: list[ast.expr] = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        named = any(isinstance(target, ast.Name) and target.id == name for target in targets)
        if named and node.value is not None:
            found.append(node.value)
    return found


def _strings_of(tree: ast.Module, name: str) -> tuple[str, ...] | None:
    """The strings of ``NAME = Literal["a", "b"]`` or ``NAME = ["a", "b"]`` at module level."""
    for value in _assignments(tree, name):
        if isinstance(value, ast.Subscript):  # Literal[...]
            value = value.slice
        if isinstance(value, ast.Tuple | ast.List):
            strings = [
                element.value
                for element in value.elts
                if isinstance(element, ast.Constant) and isinstance(element.value, str)
            ]
            if strings:
                return tuple(strings)
    return None


def _assigned_string(tree: ast.Module, name: str) -> str | None:
    """A module-level ``NAME = ... = "x"`` (``_version.py``'s ``__version__ = version = ...``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names = [target.id for target in node.targets if isinstance(target, ast.Name)]
            if name in names and isinstance(node.value.value, str):
                return node.value.value
    return None


def _replace_calls(tree: ast.Module, function: str) -> tuple[tuple[str, str], ...] | None:
    """The ``x.replace("a", "b")`` pairs in ``function`` (at any depth of the module)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name == function):
            continue
        pairs: list[tuple[str, str]] = []
        for call in ast.walk(node):
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "replace"
                and len(call.args) == 2
            ):
                continue
            old, new = call.args
            if (
                isinstance(old, ast.Constant)
                and isinstance(new, ast.Constant)
                and isinstance(old.value, str)
                and isinstance(new.value, str)
            ):
                pairs.append((old.value, new.value))
        return tuple(pairs)
    return None


def _override_names(package: Path) -> tuple[str, ...]:
    """The short strings in the quantization methods' ``override_quantization_method``: the
    checkpoint methods an override may take under another name."""
    names: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            continue
        if "def override_quantization_method" not in text:
            continue
        tree = _parse(path)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.FunctionDef) and node.name == "override_quantization_method":
                names.update(
                    sub.value
                    for sub in ast.walk(node)
                    if isinstance(sub, ast.Constant)
                    and isinstance(sub.value, str)
                    and 0 < len(sub.value) <= 32
                    and " " not in sub.value
                )
    return tuple(sorted(names))


def _field_default(tree: ast.Module, attribute: str) -> float | None:
    """The default of a class attribute declared ``name: float = Field(default=X, ...)`` or
    ``name: float = X`` anywhere in the module (``CacheConfig.gpu_memory_utilization``)."""
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == attribute
        ):
            continue
        value = node.value
        if isinstance(value, ast.Call):
            value = next((kw.value for kw in value.keywords if kw.arg == "default"), None)
        if isinstance(value, ast.Constant) and isinstance(value.value, int | float):
            return float(value.value)
    return None
