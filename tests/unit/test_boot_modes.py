"""``engine_boot_mode``: what each mode puts on the engine's command line and in its
environment, what it leaves to the user, and that a gateway started with the option spawns
its engine so (a real `gateway serve` whose engine command records what it was given).

The guarantees in the single-process mode (kill, hang, no orphan) are checked against the
real engine in tests/integration/test_boot_modes.py; the boot times come from
scripts/boot_modes.py, whose table is checked here on made-up boots.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loragate.settings import Settings, SettingsError, load_settings
from loragate.supervisor.command import EngineSpec, engine_argv, engine_env
from tools.bench.boot_modes import Boot, ModeResult, table
from tools.bench.targets import write_fake_model
from tools.harness import GatewayProcess

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
EXECUTOR = "--distributed-executor-backend"


@pytest.fixture(autouse=True)
def no_multiprocessing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine inherits the gateway's environment: these tests start without the variable."""
    monkeypatch.delenv(MULTIPROCESSING, raising=False)


def spec(**fields: Any) -> EngineSpec:
    return EngineSpec(
        model="m", served_name="m", socket_path=Path("/tmp/e.sock"), api_key="k",
        max_loras=1, max_lora_rank=8, **fields,
    )  # fmt: skip


def executor_values(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == EXECUTOR]


def test_multiprocess_is_the_default_and_adds_nothing() -> None:
    assert Settings().engine_boot_mode == "multiprocess"
    default = spec()
    assert default.boot_mode == "multiprocess"
    assert executor_values(engine_argv(default)) == []
    assert MULTIPROCESSING not in engine_env(default)


def test_single_process_turns_multiprocessing_off_and_runs_the_uni_executor() -> None:
    single = spec(boot_mode="single-process")
    assert executor_values(engine_argv(single)) == ["uni"]
    assert engine_env(single)[MULTIPROCESSING] == "0"


@pytest.mark.parametrize(
    "fields",
    [
        {"distributed_executor_backend": "mp"},
        {"extra_args": ["--distributed-executor-backend", "ray"]},
        {"extra_args": ["--distributed_executor_backend=mp"]},
    ],
    ids=["option", "after --", "underscore spelling"],
)
def test_single_process_leaves_a_users_executor_backend_alone(fields: dict[str, Any]) -> None:
    given = spec(boot_mode="single-process", **fields)
    argv = engine_argv(given)
    assert "uni" not in executor_values(argv) and "uni" not in " ".join(argv)
    assert MULTIPROCESSING not in engine_env(given)


def test_single_process_leaves_a_users_multiprocessing_variable_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(MULTIPROCESSING, "1")
    inherited = spec(boot_mode="single-process")
    assert engine_env(inherited)[MULTIPROCESSING] == "1"
    assert executor_values(engine_argv(inherited)) == []
    monkeypatch.delenv(MULTIPROCESSING)
    planned = spec(boot_mode="single-process", env={MULTIPROCESSING: "1"})
    assert engine_env(planned)[MULTIPROCESSING] == "1"
    assert executor_values(engine_argv(planned)) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"data_parallel_size": 2},
        {"extra_args": ["-tp", "2"]},
        {"extra_args": ["--data-parallel-size=4"]},
    ],
    ids=["tp", "pp", "dp", "-tp after --", "dp after --"],
)
def test_a_parallel_layout_keeps_multiprocess(fields: dict[str, Any]) -> None:
    parallel = spec(boot_mode="single-process", **fields)
    assert executor_values(engine_argv(parallel)) == []
    assert MULTIPROCESSING not in engine_env(parallel)


def test_one_worker_spelled_out_is_still_single_process() -> None:
    one = spec(boot_mode="single-process", tensor_parallel_size=1, extra_args=["-dp", "1"])
    assert executor_values(engine_argv(one)) == ["uni"]


def test_the_mode_is_a_setting_from_the_environment_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAGATE_ENGINE_BOOT_MODE", "single-process")
    assert load_settings().engine_boot_mode == "single-process"
    monkeypatch.setenv("LORAGATE_ENGINE_BOOT_MODE", "threads")
    with pytest.raises(SettingsError, match="LORAGATE_ENGINE_BOOT_MODE"):
        load_settings()


# ----- a gateway started with the option ------------------------------------------------------

# Writes what the engine was given to the file named first, then serves as the stand-in engine.
RECORDING_ENGINE = (
    "import json, os, sys\n"
    "from tools.bench.fake_engine import main\n"
    "with open(sys.argv[1], 'w') as out:\n"
    f"    json.dump({{'argv': sys.argv[2:], 'multiprocessing': os.environ.get({MULTIPROCESSING!r})}}, out)\n"
    "raise SystemExit(main(sys.argv[2:]))\n"
)


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    # The engine's socket path must fit in 107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="lg-") as name:
        yield Path(name)


@pytest.mark.parametrize("mode", ["multiprocess", "single-process"])
def test_the_gateway_spawns_its_engine_in_the_mode_it_was_given(short_tmp: Path, mode: str) -> None:
    record = short_tmp / "engine.json"
    config = short_tmp / "gateway.yaml"  # JSON is YAML
    config.write_text(
        json.dumps({"engine_command": [sys.executable, "-c", RECORDING_ENGINE, str(record)]})
    )
    model = write_fake_model(short_tmp / "model")
    gateway = GatewayProcess(
        cache_dir=short_tmp / "cache",
        args=["--model", str(model), "--config", str(config), "--engine-boot-mode", mode],
    ).start()
    try:
        gateway.wait_ready(120)
        given = json.loads(record.read_text())
    finally:
        gateway.stop()
    single = mode == "single-process"
    assert executor_values(given["argv"]) == (["uni"] if single else [])
    assert given["multiprocessing"] == ("0" if single else None)


# ----- scripts/boot_modes.py's table ----------------------------------------------------------


def boot(mode: str, seconds: float, answer: str = " Paris", processes: int = 3) -> Boot:
    return Boot(mode, seconds, ["api_server", *["proc"] * (processes - 1)], 1 << 30, answer, 0.5)


def test_the_table_gives_each_boot_the_median_and_whether_the_answers_agree() -> None:
    results = [
        ModeResult("multiprocess", [boot("multiprocess", 33.0, processes=4)] * 2),
        ModeResult("single-process", [boot("single-process", 20.0), boot("single-process", 24.0)]),
        ModeResult("odd", [boot("odd", 10.0, answer=" Lyon")]),
    ]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table(results).splitlines()}
    assert "| 33.0, 33.0 | 33.0 | 4 (" in rows["multiprocess"]
    assert "| 20.0, 24.0 | 22.0 | 3 (" in rows["single-process"]
    assert rows["multiprocess"].endswith("| yes |")
    assert rows["single-process"].endswith("| yes |")
    assert rows["odd"].endswith("| NO |")
