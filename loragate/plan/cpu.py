"""What the CPU build needs beyond the user's flags: its KV cache size, and whether it runs
loragate's CPU LoRA ops.

Without ``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes`` or ``--gpu-memory-utilization``,
vLLM's CPU worker reserves 0.92 of NUMA node 0's memory and refuses to start when less than
that is free, which the page cache alone prevents on most machines after any disk activity.
So loragate sizes the cache itself from what is actually free (counted the way vLLM counts it)
and from the longest sequence the engine will take, and passes ``--kv-cache-memory-bytes``.
A model that cannot fit is refused before the engine starts, with what would make it fit.

The LoRA ops plugin (``loragate.engine_plugin``) lives in the engine's processes; this process
never imports it (nor vLLM or torch): it asks the engine's interpreter, with the engine's
environment, in a child process.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from loragate.supervisor.command import CPU_LORA_OPS_ENV

_CHECK_TIMEOUT = 60.0


def plugin_problem(python: str, env: dict[str, str]) -> str | None:
    """Why an engine started by ``python`` with ``env`` would not get the ops; None if it would."""
    try:
        done = subprocess.run(
            [python, "-m", "loragate.engine_plugin"],
            env={**env, CPU_LORA_OPS_ENV: "1"},
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot ask {python} about the plugin: {exc}"
    if done.returncode == 0:
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if lines else f"the check exited with status {done.returncode}"


GIB = 1 << 30
# Flags and variables by which the user sizes the engine's memory themselves.
MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
MEMORY_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The engine's own runtime beside weights and KV cache: Python, torch, buffers, activations.
RUNTIME_BYTES = 3 * GIB // 2
# The KV cache takes at most this share of what is free after weights and runtime.
KV_SHARE = 0.5
# Aim for this many full-length sequences at once, within [MIN_KV, MAX_KV].
TARGET_SEQUENCES = 4
MIN_KV = GIB
MAX_KV = 8 * GIB
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class ModelDoesNotFit(ValueError):
    """The model's weights and one full-length sequence do not fit in free memory."""


@dataclass(frozen=True)
class KvCachePlan:
    kv_bytes: int
    max_model_len: int
    bytes_per_token: int
    available_bytes: int
    weights_bytes: int

    def engine_args(self) -> list[str]:
        return ["--kv-cache-memory-bytes", str(self.kv_bytes)]

    def describe(self) -> str:
        sequences = self.kv_bytes // max(1, self.bytes_per_token * self.max_model_len)
        return (
            f"KV cache {self.kv_bytes / GIB:.2f} GiB (about {sequences} sequences of "
            f"{self.max_model_len} tokens), sized by loragate from {self.available_bytes / GIB:.1f} "
            f"GiB free and {self.weights_bytes / GIB:.2f} GiB of weights; set "
            "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE after -- to choose yourself"
        )


def user_sized(engine_args: list[str], env: dict[str, str]) -> bool:
    """Whether the user chose the engine's memory: their choice always wins."""
    if env.get(MEMORY_ENV, "").strip():
        return True
    return any(
        arg == flag or arg.startswith(flag + "=") for arg in engine_args for flag in MEMORY_FLAGS
    )


def flag_value(engine_args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``engine_args`` (``--flag V`` or ``--flag=V``), last one wins."""
    value = None
    for index, arg in enumerate(engine_args):
        if arg == flag and index + 1 < len(engine_args):
            value = engine_args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def node_available_bytes(node: int = 0) -> int:
    """Free memory on NUMA node ``node`` as vLLM's CPU worker counts it (free + file cache +
    reclaimable slab), clamped by the cgroup limit; the whole machine where there is no node."""
    available = psutil.virtual_memory().available
    meminfo = Path(f"/sys/devices/system/node/node{node}/meminfo")
    try:
        fields: dict[str, int] = {}
        for line in meminfo.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
        available = sum(
            fields[key] for key in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        )
    except (OSError, KeyError, ValueError):
        pass
    return min(available, _cgroup_available() or available)


def _cgroup_available() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        usage = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - usage)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of ``config`` (vision-language models nest it)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    text = text_config(config)
    layers = int(text.get("num_hidden_layers") or 0)
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
    if not (layers and kv_heads and head_dim):
        raise ModelDoesNotFit(
            "cannot tell the model's KV cache size from its config.json (layers, heads, head "
            "dim); pass --kv-cache-memory-bytes after -- to size it yourself"
        )
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def dtype_bytes(config: dict[str, Any], engine_args: list[str]) -> int:
    chosen = flag_value(engine_args, "--dtype")
    if chosen in (None, "auto"):
        text = text_config(config)
        chosen = str(
            text.get("torch_dtype")
            or text.get("dtype")
            or config.get("torch_dtype")
            or config.get("dtype")
            or "bfloat16"
        )
    return _DTYPE_BYTES.get(str(chosen), 2)


def model_max_len(config: dict[str, Any], engine_args: list[str]) -> int:
    given = flag_value(engine_args, "--max-model-len")
    if given is not None:
        try:
            return _parse_len(given)
        except ValueError:
            pass  # the engine reports a bad value itself
    text = text_config(config)
    return int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 2048)


def _parse_len(value: str) -> int:
    lowered = value.strip().lower()
    scale = {"k": 1000, "m": 1_000_000}.get(lowered[-1:], 1)
    number = lowered[:-1] if scale != 1 else lowered
    return int(float(number) * scale)


def weights_bytes(model_dir: Path) -> int:
    return sum(
        path.stat().st_size
        for pattern in ("*.safetensors", "*.bin", "*.pt")
        for path in model_dir.glob(pattern)
    )


def plan_kv_cache(
    model_dir: Path,
    config: dict[str, Any],
    engine_args: list[str],
    available_bytes: int | None = None,
) -> KvCachePlan:
    """The KV cache for this model on this machine, or ``ModelDoesNotFit`` saying why."""
    available = node_available_bytes() if available_bytes is None else available_bytes
    per_token = kv_bytes_per_token(config, dtype_bytes(config, engine_args))
    max_len = model_max_len(config, engine_args)
    weights = weights_bytes(model_dir)
    one_sequence = per_token * max_len
    budget = int((available - weights - RUNTIME_BYTES) * KV_SHARE)
    wanted = min(max(TARGET_SEQUENCES * one_sequence, MIN_KV), MAX_KV)
    kv = min(wanted, budget)
    if kv < one_sequence or kv <= 0:
        fits = max(0, budget) // per_token
        hint = (
            f"pass --max-model-len {_round_down(fits)} after -- (the longest sequence that fits)"
            if fits >= 256
            else "free memory or use a smaller model"
        )
        raise ModelDoesNotFit(
            f"the model does not fit in this machine's free memory: {weights / GIB:.2f} GiB of "
            f"weights plus {RUNTIME_BYTES / GIB:.1f} GiB for the engine leave "
            f"{max(0, budget) / GIB:.2f} GiB for the KV cache (half of what remains of "
            f"{available / GIB:.1f} GiB free), but one sequence of {max_len} tokens needs "
            f"{one_sequence / GIB:.2f} GiB; {hint}, or size it yourself with "
            "--kv-cache-memory-bytes after --"
        )
    return KvCachePlan(kv, max_len, per_token, available, weights)


def _round_down(tokens: int) -> int:
    return max(256, 1 << int(math.log2(tokens))) if tokens > 0 else 0
