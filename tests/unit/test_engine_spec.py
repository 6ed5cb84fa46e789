"""What an engine is started with, for the kinds of model loragate serves: its argv and the
environment it adds, pinned as a whole (the demo, a catalog model asleep or not, the
zero-adapter slot, a vision model, a model whose tool-call parser is picked, a GPU share).

Each case runs the real start of a model's backend (``start(boot=False)``: the model planned,
its adapters declared) and builds one boot's command, with an engine Python that answers the
probes without vLLM (a CPU or a GPU build), a fake ``nvidia-smi`` and a fixed free memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loragate.serving.model import ModelRuntime
from loragate.settings import Settings
from loragate.supervisor.command import EngineSpec, engine_argv, engine_env
from tests.adapter_fixtures import llama_lora_shapes, peft_config, write_shaped_adapter
from tests.model_shapes import QWEN25_1_5B, model_dir
from tools.bench.targets import FAKE_MODEL_CONFIG

GiB = 1 << 30
# One 80 GiB GPU with 70 GiB free (nvidia-smi's csv, MiB).
ONE_GPU = "echo '0, GPU-aaaa-1111, NVIDIA H100, 81559, 71680'\n"
NO_GPU = "exit 9\n"


def executable(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No engine settings from this machine's environment; 16 GiB free for a CPU engine."""
    for name in (
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_CPU_KVCACHE_SPACE",
        "CUDA_VISIBLE_DEVICES",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "VLLM_PLUGINS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("loragate.plan.cpu.node_available_bytes", lambda node=0: 16 * GiB)
    yield


def gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    bin_dir = tmp_path / "bin"
    executable(bin_dir / "nvidia-smi", script)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def engine_python(tmp_path: Path, *, cpu_build: bool) -> str:
    """A Python that says it is (or is not) vLLM's CPU build, takes loragate's CPU LoRA ops,
    and names no installed vLLM (the tool-call parsers are then vLLM 0.32's list)."""
    name = "cpu-python" if cpu_build else "gpu-python"
    return str(executable(tmp_path / name, "exit 0\n" if cpu_build else "exit 1\n"))


def llama(directory: Path, config: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or FAKE_MODEL_CONFIG))
    return directory


def adapter(directory: Path, config: dict[str, Any] | None = None) -> Path:
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return write_shaped_adapter(
        directory, llama_lora_shapes(config or FAKE_MODEL_CONFIG), peft_config(modules=modules)
    )


def qwen_with_tools(directory: Path) -> Path:
    """A Qwen2.5-shaped model whose chat template renders tools (its parser: hermes)."""
    model_dir(directory, QWEN25_1_5B)
    template = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


async def started_with(
    settings: Settings, tmp_path: Path, *, sleep_mode: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The argv of one boot of ``settings``' engine, and what it adds to the environment,
    with ``tmp_path`` written as ``{tmp}``."""
    backend = ModelRuntime(settings)
    backend.sleep_mode = sleep_mode
    await backend.start()
    try:
        await backend.until_prepared(None)
        assert backend.prepare_error is None, backend.prepare_error
        spec = backend._engine_spec(tmp_path / "engine.sock", "per-boot-key")
        argv, env = engine_argv(spec), engine_env(spec)
    finally:
        await backend.stop()
    added = {name: value for name, value in env.items() if os.environ.get(name) != value}
    added.pop("PYTHONUNBUFFERED", None)
    tmp = str(tmp_path)
    return [arg.replace(tmp, "{tmp}") for arg in argv], {
        name: value.replace(tmp, "{tmp}") for name, value in added.items()
    }


def lora_module(name: str, path: str, base: str) -> str:
    return json.dumps({"name": name, "path": path, "base_model_name": base})


ENGINE = ["-m", "vllm.entrypoints.openai.api_server"]
QUIET = ["--disable-access-log-for-endpoints", "/health,/metrics,/v1/models",
         "--disable-uvicorn-access-log"]  # fmt: skip
MEDIA = ["--allowed-media-domains", "loragate.invalid"]
MEDIA_ENV = {"VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "20", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
LORA_API = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "VLLM_API_KEY": "per-boot-key"}
# What every adapter() writes, stored under its digest.
STORED = (
    "{tmp}/cache/adapters/versions/838c48c40b4eed2cd64409168b73bb0ead4ae1e706aa504a586bcbda39048ce7"
)
ZERO = "{tmp}/cache/adapters/zero/4f8ddca7914ce699"
STRUCTURED = '{"backend": "xgrammar", "disable_any_whitespace": true}'


async def test_the_tiny_demo_on_the_cpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: None
) -> None:
    demo = tmp_path / "demo"
    llama(demo / "base")
    for name in ("pong", "fox", "owl"):
        adapter(demo / "adapters" / name)
    monkeypatch.setattr("loragate.plan.engine_plan.ensure_demo", lambda path, python: demo)
    settings = Settings(
        demo="tiny", engine_python=engine_python(tmp_path, cpu_build=True),
        cache_dir=tmp_path / "cache",
    )  # fmt: skip
    argv, env = await started_with(settings, tmp_path)
    assert argv == [
        "{tmp}/cpu-python", *ENGINE, "--model", "{tmp}/demo/base",
        "--served-model-name", "loragate-demo", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", *QUIET,
        "--lora-modules",
        lora_module("pong@838c48c40b4e", STORED, "loragate-demo"),
        lora_module("fox@838c48c40b4e", STORED, "loragate-demo"),
        lora_module("owl@838c48c40b4e", STORED, "loragate-demo"),
        "--dtype", "float32", "--structured-outputs-config", STRUCTURED,
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        "--kv-cache-memory-bytes", "1073741824", *MEDIA,
    ]  # fmt: skip
    assert env == {**MEDIA_ENV, "LORAGATE_CPU_LORA_OPS": "1", **LORA_API}


async def test_the_zero_adapter_slot_on_the_cpu_build_without_loragates_ops(
    tmp_path: Path, machine: None
) -> None:
    settings = Settings(
        model=str(llama(tmp_path / "model")), engine_python=engine_python(tmp_path, cpu_build=True),
        cache_dir=tmp_path / "cache", cpu_lora_ops=False, max_loras=2,
        lora=[f"support={adapter(tmp_path / 'support')}"],
    )  # fmt: skip
    argv, env = await started_with(settings, tmp_path)
    assert argv == [
        "{tmp}/cpu-python", *ENGINE, "--model", "{tmp}/model",
        "--served-model-name", "model", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", *QUIET,
        "--lora-modules",
        lora_module("__base__@4f8ddca7914c", ZERO, "model"),
        lora_module("support@838c48c40b4e", STORED, "model"),
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        "--kv-cache-memory-bytes", "1073741824", *MEDIA,
    ]  # fmt: skip
    assert env == {**MEDIA_ENV, "LORAGATE_CPU_LORA_OPS": "0", **LORA_API}


async def test_a_vision_model_in_one_process_where_sleep_mode_does_not_exist(
    tmp_path: Path, machine: None
) -> None:
    config = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "text_config": {**FAKE_MODEL_CONFIG, "max_position_embeddings": 512},
        "vision_config": {"hidden_size": 64, "num_hidden_layers": 2},
    }
    settings = Settings(
        model=str(llama(tmp_path / "vision", config)),
        engine_python=engine_python(tmp_path, cpu_build=True), cache_dir=tmp_path / "cache",
        tool_call_parser="none", engine_boot_mode="single-process", max_image_bytes=5_000_000,
        engine_args=["--limit-mm-per-prompt", '{"image":1}'],
    )  # fmt: skip
    argv, env = await started_with(settings, tmp_path, sleep_mode=True)
    assert argv == [
        "{tmp}/cpu-python", *ENGINE, "--model", "{tmp}/vision",
        "--served-model-name", "vision", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", *QUIET,
        "--distributed-executor-backend", "uni",
        "--kv-cache-memory-bytes", "1073741824", *MEDIA,
        "--limit-mm-per-prompt", '{"image":1}',
    ]  # fmt: skip
    assert env == {
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": "5", "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
        "LORAGATE_CPU_LORA_OPS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **LORA_API,
    }  # fmt: skip


async def test_a_model_whose_tool_parser_is_picked_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: None
) -> None:
    gpus(tmp_path, monkeypatch, ONE_GPU)
    settings = Settings(
        model=str(qwen_with_tools(tmp_path / "qwen")),
        engine_python=engine_python(tmp_path, cpu_build=False), cache_dir=tmp_path / "cache",
        max_cpu_loras=4, otlp_traces_endpoint="http://collector:4318/v1/traces",
        engine_args=["--max-model-len", "8192"],
    )  # fmt: skip
    argv, env = await started_with(settings, tmp_path)
    assert argv == [
        "{tmp}/gpu-python", *ENGINE, "--model", "{tmp}/qwen",
        "--served-model-name", "qwen", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", *QUIET,
        "--max-cpu-loras", "4", "--otlp-traces-endpoint", "http://collector:4318/v1/traces",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--gpu-memory-utilization", "0.872", *MEDIA, "--max-model-len", "8192",
    ]  # fmt: skip
    assert env == {**MEDIA_ENV, "CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111", **LORA_API}


async def test_a_catalog_model_asleep_when_unloaded_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: None
) -> None:
    from loragate.plan.engine_spec import model_settings

    gpus(tmp_path, monkeypatch, ONE_GPU)
    settings = Settings(
        models={
            "alpha": {
                "model": str(qwen_with_tools(tmp_path / "qwen")), "sleep": True,
                "engine_args": ["--max-model-len", "4096"],
            },
            "beta": {"model": str(llama(tmp_path / "llama"))},
        },
        engine_python=engine_python(tmp_path, cpu_build=False), cache_dir=tmp_path / "cache",
        tool_call_parser="pythonic", engine_args=["--enforce-eager"],
    )  # fmt: skip
    alpha = model_settings(settings, "alpha", settings.models["alpha"])
    argv, env = await started_with(alpha, tmp_path, sleep_mode=True)
    assert argv == [
        "{tmp}/gpu-python", *ENGINE, "--model", "{tmp}/qwen",
        "--served-model-name", "alpha", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", *QUIET,
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
        "--gpu-memory-utilization", "0.872", *MEDIA, "--enable-sleep-mode",
        "--enforce-eager", "--max-model-len", "4096",
    ]  # fmt: skip
    assert env == {
        **MEDIA_ENV, "CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111", "VLLM_SERVER_DEV_MODE": "1",
        **LORA_API,
    }  # fmt: skip


async def test_a_gpu_build_without_nvidia_smi_gets_vllms_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: None
) -> None:
    gpus(tmp_path, monkeypatch, NO_GPU)
    settings = Settings(
        model=str(llama(tmp_path / "model")), engine_python=engine_python(tmp_path, cpu_build=False),
        cache_dir=tmp_path / "cache", base_routing="zero-adapter", tensor_parallel_size=1,
    )  # fmt: skip
    argv, env = await started_with(settings, tmp_path, sleep_mode=True)
    assert argv == [
        "{tmp}/gpu-python", *ENGINE, "--model", "{tmp}/model",
        "--served-model-name", "model", "--uds", "{tmp}/engine.sock",
        "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16", *QUIET,
        "--tensor-parallel-size", "1",
        "--lora-modules", lora_module("__base__@4f8ddca7914c", ZERO, "model"),
        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic", *MEDIA,
        "--enable-sleep-mode",
    ]  # fmt: skip
    assert env == {**MEDIA_ENV, "VLLM_SERVER_DEV_MODE": "1", **LORA_API}


async def test_a_catalogs_gpu_placement_is_the_one_the_engine_boots_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: None
) -> None:
    from loragate.plan.gpu.placement import Placement

    gpus(tmp_path, monkeypatch, NO_GPU)  # what it gets comes from the catalog's plan alone
    settings = Settings(
        model=str(llama(tmp_path / "model")), engine_python=engine_python(tmp_path, cpu_build=False),
        cache_dir=tmp_path / "cache", tool_call_parser="none",
    )  # fmt: skip
    backend = ModelRuntime(settings)
    backend.gpu_placement = Placement(
        "model", fits=True, devices=[1], share=0.4, held_bytes={1: 7 * GiB},
        args=["--gpu-memory-utilization", "0.4"], env={"CUDA_VISIBLE_DEVICES": "GPU-bbbb-2222"},
    )  # fmt: skip
    await backend.start()
    try:
        await backend.until_prepared(None)
        spec = backend._engine_spec(tmp_path / "engine.sock", "key")
    finally:
        await backend.stop()
    argv = engine_argv(spec)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.4"
    assert engine_env(spec)["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb-2222"
    assert backend.gpu_held == {1: 7 * GiB} and backend.memory_bytes == 7 * GiB


# ----- the flags loragate sets: one table ------------------------------------------------------


def spec_with(**fields: Any) -> EngineSpec:
    return EngineSpec("m", "m", max_loras=2, max_lora_rank=8, **fields).for_boot(
        Path("/tmp/e.sock"), "key", {"a@1": Path("/store/a")}
    )


# Every optional part of the spec switched on (one engine each way where two exclude each other).
EVERY_PART: dict[str, Any] = {
    "max_cpu_loras": 4,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "data_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "otlp_traces_endpoint": "http://collector:4318",
    "model_flags": {"--dtype": "float32", "--structured-outputs-config": "{}"},
    "tool_call_parser": "hermes",
    "kv_cache_memory_bytes": GiB,
    "gpu_memory_utilization": 0.5,
    "visible_devices": "0",
    "cpu_lora_ops": True,
    "sleep_mode": True,
}


def loragates_flags(spec: EngineSpec) -> list[str]:
    """The flags of loragate's part of ``spec``'s command line (the engine's own and the user's
    arguments aside)."""
    argv = engine_argv(spec)
    ours = argv[3 : len(argv) - len(spec.extra_args)]
    return [arg for arg in ours if arg.startswith("--")]


def test_every_flag_the_spec_sets_is_a_row_of_the_table_and_every_row_is_set() -> None:
    from loragate.engine_flags import ENGINE_FLAGS, OWNED_FLAGS

    specs = [spec_with(), spec_with(**EVERY_PART), spec_with(boot_mode="single-process")]
    emitted = {flag for spec in specs for flag in loragates_flags(spec)}
    assert emitted == {flag for flag, rule in ENGINE_FLAGS.items() if rule.passed}
    never_passed = {flag for flag, rule in ENGINE_FLAGS.items() if not rule.passed}
    assert never_passed == {
        "--port", "--host", "--api-key", "--allowed-local-media-path", "--allowed-origins",
    }  # fmt: skip
    # Owned: the set rows a user may not override, and the rows loragate does its own way.
    defaults = {flag for flag, rule in ENGINE_FLAGS.items() if rule.instead is None}
    assert set(OWNED_FLAGS) == (emitted - defaults) | never_passed


def test_an_owned_flag_after_the_separator_is_refused_saying_what_to_use() -> None:
    from loragate.engine_flags import OWNED_FLAGS, check_engine_args

    for flag, use in OWNED_FLAGS.items():
        for given in ([flag, "x"], [f"{flag}=x"], [flag.replace("-", "_").replace("__", "--")]):
            with pytest.raises(ValueError) as refused:
                check_engine_args(given)
            assert f"{given[0].split('=')[0]}: {use}" in str(refused.value)


def test_a_default_flag_after_the_separator_replaces_loragates_own() -> None:
    from loragate.engine_flags import ENGINE_FLAGS

    for flag, rule in ENGINE_FLAGS.items():
        if rule.instead is not None:
            continue
        for given in (
            [flag, "2"],
            [f"{flag}=2"],
            [f"{flag}.key", "2"],
            *([a, "2"] for a in rule.yields_to),
        ):
            spec = spec_with(**EVERY_PART, extra_args=given)
            assert flag not in loragates_flags(spec), given
    # Theirs stays where it was: last.
    spec = spec_with(**EVERY_PART, extra_args=["--dtype", "bfloat16"])
    assert engine_argv(spec)[-2:] == ["--dtype", "bfloat16"] and "float32" not in engine_argv(spec)


def test_a_flag_outside_the_table_cannot_be_set() -> None:
    from loragate.engine_flags import loragate_passes

    with pytest.raises(KeyError):
        loragate_passes("--max-model-len", [])
    with pytest.raises(KeyError):
        loragate_passes("--port", [])  # owned, and never passed


def test_the_planned_spec_is_frozen_and_each_boot_gets_a_copy_of_its_own() -> None:
    planned = EngineSpec("m", "m", max_loras=2, max_lora_rank=8, extra_args=["--enforce-eager"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.max_loras = 3  # type: ignore[misc]
    assert planned.extra_args == ("--enforce-eager",)
    modules = {"a@1": Path("/store/a")}
    boot = planned.for_boot(Path("/tmp/e.sock"), "key", modules)
    modules["b@2"] = Path("/store/b")  # the manager's next boot
    assert list(boot.lora_modules) == ["a@1"] and planned.socket_path is None
    with pytest.raises(ValueError, match="for_boot"):
        engine_argv(planned)


def test_the_cpu_lora_ops_switch_is_the_one_the_engine_plugin_reads() -> None:
    from loragate import engine_plugin
    from loragate.supervisor.command import CPU_LORA_OPS_ENV

    assert CPU_LORA_OPS_ENV == engine_plugin.ENV_SWITCH
