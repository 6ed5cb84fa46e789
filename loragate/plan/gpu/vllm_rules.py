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
  the share: an engine holds its context plus its share.
- **What the share holds.** The KV cache gets the share less the weights, the profiled peak
  activations, the memory outside torch and the CUDA graphs' estimate
  (``gpu_worker.py:740-744``, ``utils/mem_utils.py:321``).
- **One full sequence.** ``v1/core/kv_cache_utils.py:1003-1040`` raises "To serve at least one
  request with the model's max seq len ..." unless that KV cache holds one ``max_model_len``
  sequence, in whole blocks of 16 tokens (``v1/kv_cache_interface.py:607``,
  ``config/cache.py:72``).
- **Quantization names.** ``config/model.py:1451-1456`` refuses a method outside
  ``QuantizationMethods`` (``model_executor/layers/quantization/__init__.py:15``), refuses a
  ``--quantization`` other than the checkpoint's own (``config/model.py:1443-1449``), and one of
  ``DEPRECATED_QUANTIZATION_METHODS`` (``__init__.py:52``) without
  ``--allow-deprecated-quantization`` (``config/model.py:1458-1471``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

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
# nvidia-smi's total counts what the driver reserves (up to about 1% of the card); the total
# vLLM multiplies the share by (torch's) does not. Needs are sized against the smaller one.
DRIVER_RESERVE_FRACTION = 0.01
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
DEFAULT_SHARE_0_32 = 0.92

_QUANTIZATION_FILE = "model_executor/layers/quantization/__init__.py"
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
    return EngineRules(
        methods,
        deprecated or (),
        share or DEFAULT_SHARE_0_32,
        version,
        str(root / _QUANTIZATION_FILE),
    )


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
