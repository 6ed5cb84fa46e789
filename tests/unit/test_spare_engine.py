"""The spare engine's rules (``loragate.supervisor.spare``): when a gateway keeps one, which
boot it may take, and the order a boot hands it. The spare's own process, its boots and its
guarantees on the real engine: tests/integration/test_spare_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loragate.settings import Settings
from loragate.supervisor.command import ENGINE_MODULE
from loragate.supervisor.process import ENGINE_TAG
from loragate.supervisor.spare import SpareEngine, SpareEngines, import_time_env, spare_engines

ARGV = [sys.executable, "-m", ENGINE_MODULE, "--model", "/m", "--enable-lora"]
ENV = {"PATH": "/usr/bin", "PYTHONUNBUFFERED": "1", "LD_PRELOAD": "", "VLLM_CPU_KVCACHE_SPACE": "1"}


def catalog(count: int, **values: object) -> Settings:
    models = {f"m{i}": {"model": f"/m/{i}"} for i in range(count)}
    return Settings(models=models, **values)


def test_a_catalog_of_several_models_keeps_a_spare_by_default_and_one_model_does_not(
    tmp_path: Path,
) -> None:
    assert spare_engines(catalog(2, cache_dir=tmp_path), models=2) is not None
    assert spare_engines(catalog(1, cache_dir=tmp_path), models=1) is None
    assert spare_engines(Settings(model="/m", cache_dir=tmp_path), models=1) is None


def test_the_setting_turns_it_on_or_off_and_an_engine_command_never_has_one(
    tmp_path: Path,
) -> None:
    assert spare_engines(Settings(model="/m", spare_engine=True, cache_dir=tmp_path), models=1)
    assert spare_engines(catalog(2, spare_engine=False, cache_dir=tmp_path), models=2) is None
    command = ["python", "-m", "stand_in"]
    assert (
        spare_engines(
            catalog(2, spare_engine=True, engine_command=command, cache_dir=tmp_path), models=2
        )
        is None
    )


def waiting(env: dict[str, str], python: str = sys.executable) -> SpareEngine:
    """A stand-in spare: a process that prints the one line it is handed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print(sys.stdin.readline(), end='')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    return SpareEngine(proc, "spare-tag", python, {**env, ENGINE_TAG: "spare-tag"}, time.time())


@pytest.mark.parametrize(
    "change",
    [{"VLLM_CPU_KVCACHE_SPACE": "4"}, {"VLLM_API_KEY": "per-boot"}, {"HOME": "/elsewhere"}],
)
def test_a_spare_serves_a_boot_whose_import_time_environment_is_its_own(
    change: dict[str, str],
) -> None:
    """vLLM reads its VLLM_* settings when it uses them (vllm/envs.py), after the import."""
    spare = waiting(ENV)
    try:
        assert spare.serves(ARGV, {**ENV, **change})
    finally:
        spare.proc.kill()
        spare.proc.wait()


@pytest.mark.parametrize(
    "argv, change",
    [
        (ARGV, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}),
        (ARGV, {"OMP_NUM_THREADS": "1"}),
        (ARGV, {"VLLM_LOGGING_LEVEL": "DEBUG"}),
        (["/other/python", *ARGV[1:]], {}),
        ([sys.executable, "-m", "stand_in", "--model", "/m"], {}),
    ],
    ids=["allocator", "threads", "logging", "another-python", "another-engine"],
)
def test_a_spare_does_not_serve_a_boot_that_would_import_differently(
    argv: list[str], change: dict[str, str]
) -> None:
    spare = waiting(ENV)
    try:
        assert not spare.serves(argv, {**ENV, **change})
    finally:
        spare.proc.kill()
        spare.proc.wait()


def test_a_dead_spare_serves_nothing() -> None:
    spare = waiting(ENV)
    spare.proc.kill()
    spare.proc.wait()
    assert not spare.serves(ARGV, ENV)


def test_the_order_carries_the_boots_arguments_and_environment_under_the_spares_tag(
    tmp_path: Path,
) -> None:
    spares = SpareEngines(tmp_path, python=sys.executable, grace=5)
    spare = spares._spare = waiting(ENV)
    env = {**ENV, "VLLM_API_KEY": "k", ENGINE_TAG: "boot-tag"}
    taken = spares.take(ARGV, env)
    assert taken is spare
    assert spares.waiting is None and spares.taken == 1
    assert spare.proc.stdout is not None
    order = json.loads(spare.proc.stdout.read())
    spare.proc.wait(10)
    assert order["args"] == ARGV[3:]
    assert order["env"][ENGINE_TAG] == "spare-tag"  # the sweep finds the spare's processes
    assert order["env"]["VLLM_API_KEY"] == "k"
    assert env[ENGINE_TAG] == "spare-tag"  # what the boot records as its tag


def test_a_spare_that_cannot_serve_the_boot_is_ended_and_the_boot_spawns_as_before(
    tmp_path: Path,
) -> None:
    spares = SpareEngines(tmp_path, python=sys.executable, grace=5)
    spare = spares._spare = waiting(ENV)
    assert spares.take(ARGV, {**ENV, "LD_PRELOAD": "/lib/x.so"}) is None
    assert spare.proc.wait(10) is not None
    assert spares.waiting is None and spares.taken == 0


def test_import_time_env_keeps_what_a_process_reads_while_it_imports() -> None:
    kept = import_time_env({**ENV, "OMP_NUM_THREADS": "2", "VLLM_PLUGINS": "x", "HOME": "/h"})
    assert kept == {
        "PYTHONUNBUFFERED": "1",
        "LD_PRELOAD": "",
        "OMP_NUM_THREADS": "2",
        "VLLM_PLUGINS": "x",
    }
