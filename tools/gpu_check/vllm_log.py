"""What vLLM's engine log says about memory, read back from its lines, and ``gateway plan``'s
numbers held against it. No GPU here: this part runs in the suite with fixture lines
(tests/unit/test_gpu_check.py).

The lines, as vLLM 0.32 writes them (file and line in the installed ``vllm`` package; each
message follows vLLM's prefix ``(EngineCore pid=N) INFO MM-DD HH:MM:SS [file.py:N]``):

- ``v1/engine/core.py:134``: "Initializing a V1 LLM engine (v%s) with config: %s", the
  config's ``dtype=torch.X`` and ``max_seq_len=N`` among it (``config/vllm.py`` ``__str__``);
- ``v1/worker/gpu_model_runner.py:5150``: "Model loading took %s GiB memory and %.6f seconds";
- ``v1/worker/gpu_worker.py:760``: "Available KV cache memory: %s GiB";
- ``v1/core/kv_cache_utils.py:2328``: "%s KV cache size: %s tokens, Maximum concurrency for
  %s tokens per request: %.2fx" (``GPU``, or ``CPU`` on the CPU build; tokens with commas);
- ``v1/worker/gpu_model_runner.py:6582``: "Graph capturing finished in %.0f secs, took %.2f GiB";
- ``v1/engine/core.py:386-403``: "init engine (profile, create kv cache, warmup model) took
  %.2f s" (with the compilation's seconds after it when there was one);
- ``platforms/cuda.py:507``: "Using %s attention backend out of potential backends: %s.";
- ``v1/worker/gpu_worker.py:327``: "Sleep mode freed %s GiB memory, %s GiB memory is still in
  use." (the second number is the whole device's, other processes included).

GiB figures are ``format_gib``'s (``vllm/utils/mem_utils.py``: rounded to 2 decimals).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

_CONFIG = re.compile(
    r"Initializing a V1 LLM engine \(v(?P<version>[^)]+)\) with config: (?P<config>.*)"
)
_DTYPE = re.compile(r"\bdtype=torch\.(?P<dtype>\w+)")
_MAX_SEQ = re.compile(r"\bmax_seq_len=(?P<n>\d+)")
_LOADING = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB memory and (?P<s>[\d.]+) seconds")
_AVAILABLE = re.compile(r"Available KV cache memory: (?P<gib>-?[\d.]+) GiB")
_KV_SIZE = re.compile(
    r"(?P<pool>[A-Z]+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, "
    r"Maximum concurrency for (?P<len>[\d,]+) tokens per request: (?P<x>[\d.]+)x"
)
_GRAPHS = re.compile(r"Graph capturing finished in (?P<s>\d+) secs, took (?P<gib>[\d.]+) GiB")
_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s")
_BACKEND = re.compile(r"Using (?P<backend>\w+) attention backend out of potential backends")
_SLEEP = re.compile(
    r"Sleep mode freed (?P<freed>[\d.]+) GiB memory, (?P<used>[\d.]+) GiB memory is still in use"
)


def _gib(text: str) -> int:
    return round(float(text) * GIB)


@dataclass
class EngineLog:
    """One engine's boot as its log tells it; the last boot's, when the log holds several."""

    version: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    weights_bytes: int | None = None  # "Model loading took": weights and LoRA slots
    load_seconds: float | None = None
    kv_cache_bytes: int | None = None  # "Available KV cache memory"
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    graph_bytes: int | None = None
    graph_seconds: float | None = None
    init_seconds: float | None = None
    attention_backend: str | None = None
    boots: int = 0
    # Each sleep: (bytes freed, bytes still in use on the device).
    sleeps: list[tuple[int, int]] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            f"vLLM {self.version}" if self.version else None,
            f"dtype {self.dtype}" if self.dtype else None,
            f"{self.attention_backend} attention" if self.attention_backend else None,
            f"weights {self.weights_bytes / GIB:.2f} GiB"
            if self.weights_bytes is not None
            else None,
            f"KV cache {self.kv_cache_bytes / GIB:.2f} GiB"
            if self.kv_cache_bytes is not None
            else None,
            f"{self.kv_cache_tokens:,} tokens" if self.kv_cache_tokens is not None else None,
            f"CUDA graphs {self.graph_bytes / GIB:.2f} GiB"
            if self.graph_bytes is not None
            else None,
            f"init {self.init_seconds:.1f} s" if self.init_seconds is not None else None,
        ]
        return ", ".join(p for p in parts if p) or "nothing vLLM logs about memory"


def parse_engine_log(lines: Iterable[str]) -> EngineLog:
    log = EngineLog()
    for line in lines:
        if found := _CONFIG.search(line):
            log.boots += 1
            log.version = found["version"]
            config = found["config"]
            if dtype := _DTYPE.search(config):
                log.dtype = dtype["dtype"]
            if seq := _MAX_SEQ.search(config):
                log.max_model_len = int(seq["n"])
        elif found := _LOADING.search(line):
            log.weights_bytes, log.load_seconds = _gib(found["gib"]), float(found["s"])
        elif found := _AVAILABLE.search(line):
            log.kv_cache_bytes = _gib(found["gib"])
        elif found := _KV_SIZE.search(line):
            log.kv_cache_tokens = int(found["tokens"].replace(",", ""))
            log.max_model_len = int(found["len"].replace(",", ""))
            log.max_concurrency = float(found["x"])
        elif found := _GRAPHS.search(line):
            log.graph_seconds, log.graph_bytes = float(found["s"]), _gib(found["gib"])
        elif found := _INIT.search(line):
            log.init_seconds = float(found["s"])
        elif found := _BACKEND.search(line):
            log.attention_backend = found["backend"]
        elif found := _SLEEP.search(line):
            log.sleeps.append((_gib(found["freed"]), _gib(found["used"])))
    return log


# How far the plan's KV cache may be from vLLM's: the plan models what the share holds besides
# the KV cache (weights, activations, LoRA slots, CUDA graphs); a quarter of that, or 512 MiB
# when it is small, is the error allowed. Past it the plan would call a tight model wrongly.
KV_TOLERANCE_SHARE = 0.25
KV_TOLERANCE_FLOOR = 512 * MIB


@dataclass
class PlanCheck:
    """``gateway plan``'s engine (``--json``'s ``engines[0]``) against what vLLM logged."""

    lines: list[str]
    problems: list[str]


def check_plan(
    plan_engine: dict[str, Any],
    log: EngineLog,
    gpu_total_bytes: int,
    engine_share: float | None,
) -> PlanCheck:
    """Compare the share, the weights, the KV cache and its tokens. ``engine_share`` is the
    ``--gpu-memory-utilization`` the engine booted with (the gateway passes the plan's)."""
    lines: list[str] = []
    problems: list[str] = []
    share = plan_engine.get("gpu_memory_utilization")
    if plan_engine.get("fits") is not True or share is None:
        return PlanCheck(
            lines, [f"the plan does not say the demo fits: {plan_engine.get('reason')}"]
        )
    lines.append(f"share: plan {share}, engine {engine_share}")
    if engine_share is None or abs(float(share) - engine_share) > 0.0015:
        problems.append(f"the engine booted with a share of {engine_share}, the plan says {share}")

    weights = plan_engine.get("weights_bytes")
    if weights and log.weights_bytes is not None:
        lines.append(
            f"weights: plan {weights / GIB:.2f} GiB, vLLM loaded {log.weights_bytes / GIB:.2f} GiB "
            f"(with the LoRA slots; ratio {log.weights_bytes / weights:.2f})"
        )
    kv_plan = plan_engine.get("kv_cache_bytes")
    if kv_plan is None or log.kv_cache_bytes is None:
        problems.append(
            "no KV cache size to compare: "
            + (
                "the plan gives none"
                if kv_plan is None
                else "vLLM logged no 'Available KV cache memory'"
            )
        )
        return PlanCheck(lines, problems)
    held_apart = max(float(share) * gpu_total_bytes - kv_plan, 0.0)
    allowed = max(KV_TOLERANCE_FLOOR, KV_TOLERANCE_SHARE * held_apart)
    error = kv_plan - log.kv_cache_bytes
    lines.append(
        f"KV cache: plan {kv_plan / GIB:.2f} GiB, vLLM {log.kv_cache_bytes / GIB:.2f} GiB "
        f"(plan {'over' if error > 0 else 'under'} by {abs(error) / MIB:.0f} MiB; allowed "
        f"{allowed / MIB:.0f} MiB: a quarter of the {held_apart / GIB:.2f} GiB the plan keeps "
        "for weights, activations, LoRA slots and graphs)"
    )
    if abs(error) > allowed:
        problems.append(
            f"the plan's KV cache is {abs(error) / MIB:.0f} MiB "
            f"{'more' if error > 0 else 'less'} than vLLM's (allowed {allowed / MIB:.0f} MiB)"
        )
    one_sequence, max_len = (
        plan_engine.get("one_sequence_kv_bytes"),
        plan_engine.get("max_model_len"),
    )
    if one_sequence and max_len and log.kv_cache_tokens is not None:
        per_token = one_sequence / max_len
        lines.append(
            f"KV tokens: plan {kv_plan / per_token:,.0f}, vLLM {log.kv_cache_tokens:,} "
            f"({per_token / 1024:.0f} KiB a token; max_model_len plan {max_len}, "
            f"vLLM {log.max_model_len})"
        )
    return PlanCheck(lines, problems)
