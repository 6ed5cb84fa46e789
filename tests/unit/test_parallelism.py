"""Parallelism as `gateway serve` options: how they reach the engine's command line, given
before `--` or after it (vLLM's aliases too), and the preflight that refuses a layout this
machine cannot run, against faked GPU inventories (no GPU here)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from loragate.cli import app
from loragate.engine_flags import ParallelLayout, engine_arg_value, parallel_layout
from loragate.plan.preflight import check_resolved_model, run_preflight
from loragate.plan.preflight.host import find_free_port
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.parallel import check_parallel
from loragate.plan.preflight.problem import PreflightError, PreflightProblem
from loragate.settings import Settings, load_settings
from loragate.supervisor.command import EngineSpec, engine_argv

GiB = 1 << 30
H100 = "NVIDIA H100 80GB"


def gpus(count: int, free_gib: float = 79, name: str = H100) -> list[GpuInfo]:
    return [GpuInfo(str(i), name, 80 * GiB, int(free_gib * GiB)) for i in range(count)]


def spec(**fields: Any) -> EngineSpec:
    return EngineSpec(
        model="m", served_name="m", socket_path=Path("/tmp/e.sock"), api_key="k",
        max_loras=1, max_lora_rank=8, command=["engine"], **fields,
    )  # fmt: skip


def layout(*args: str, **options: int | str | None) -> ParallelLayout:
    names = {
        "tp": "--tensor-parallel-size",
        "pp": "--pipeline-parallel-size",
        "dp": "--data-parallel-size",
        "backend": "--distributed-executor-backend",
    }
    return parallel_layout(list(args), {names[key]: value for key, value in options.items()})


def gpu_problems(
    plan: ParallelLayout, inventory: list[GpuInfo], **env: str
) -> list[PreflightProblem]:
    return check_parallel(plan, "gpu", inventory, engine_python=None, numa_nodes=lambda: 1, env=env)


def cpu_problems(plan: ParallelLayout, numa: int = 1, **env: str) -> list[str]:
    found = check_parallel(plan, "cpu", [], engine_python=None, numa_nodes=lambda: numa, env=env)
    return [problem.message for problem in found]


def sparse_model(model_dir: Path, size: int) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    with (model_dir / "model.safetensors").open("wb") as file:
        file.truncate(size)
    return model_dir


# ----- the engine's command line ------------------------------------------------------------


def test_options_reach_the_engine_command_line_under_vllms_names() -> None:
    argv = engine_argv(
        spec(
            tensor_parallel_size=4,
            pipeline_parallel_size=2,
            data_parallel_size=2,
            distributed_executor_backend="ray",
        )
    )
    joined = " ".join(argv)
    assert "--tensor-parallel-size 4" in joined
    assert "--pipeline-parallel-size 2" in joined
    assert "--data-parallel-size 2" in joined
    assert "--distributed-executor-backend ray" in joined


def test_no_parallel_flags_by_default() -> None:
    assert not any("parallel" in arg or "executor" in arg for arg in engine_argv(spec()))


@pytest.mark.parametrize(
    "extra", [["-tp", "2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"]]
)
def test_an_option_also_given_after_the_separator_reaches_the_engine_once(
    extra: list[str],
) -> None:
    argv = engine_argv(spec(tensor_parallel_size=2, extra_args=extra))
    assert argv[-len(extra) :] == extra
    assert argv.count("--tensor-parallel-size") == extra.count("--tensor-parallel-size")


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["-tp", "2"], "2"),
        (["-tp=2"], "2"),
        (["--tensor-parallel-size", "2"], "2"),
        (["--tensor-parallel-size=2"], "2"),
        (["-tp", "2", "--dtype", "half", "-tp", "8"], "8"),  # argparse: the last one wins
        (["--dtype", "half"], None),
        (["--tensor-parallel-size-x", "3"], None),
    ],
)
def test_engine_arguments_are_read_as_argparse_reads_them(
    args: list[str], value: str | None
) -> None:
    assert engine_arg_value(args, "--tensor-parallel-size", ("-tp",)) == value


# ----- settings: both ways, aliases, conflicts ----------------------------------------------


def test_layout_reads_options_and_aliases_after_the_separator() -> None:
    settings = Settings(tensor_parallel_size=2, engine_args=["-pp", "2", "-dp=3"])
    assert settings.parallel == ParallelLayout(tensor=2, pipeline=2, data=3)
    assert settings.parallel.local_workers == 12


def test_the_same_value_given_both_ways_is_fine() -> None:
    settings = Settings(tensor_parallel_size=2, engine_args=["--tensor-parallel-size=2"])
    assert settings.parallel.tensor == 2


@pytest.mark.parametrize(
    ("options", "args", "says"),
    [
        ({"tensor_parallel_size": 2}, ["-tp", "4"], "--tensor-parallel-size is 2 but the engine "
         "arguments after `--` say -tp 4: give it once"),
        ({"pipeline_parallel_size": 2}, ["--pipeline-parallel-size=3"], "say "
         "--pipeline-parallel-size 3"),
        ({"data_parallel_size": 2}, ["-dp", "1"], "--data-parallel-size is 2"),
        ({"distributed_executor_backend": "mp"}, ["--distributed-executor-backend", "ray"],
         "--distributed-executor-backend is mp but"),
        ({}, ["-tp", "two"], "--tensor-parallel-size takes a whole number, not 'two'"),
        ({}, ["-pp", "0"], "--pipeline-parallel-size must be at least 1, not 0"),
        ({}, ["--distributed-executor-backend", "slurm"], "takes one of mp, ray, uni"),
    ],
)  # fmt: skip
def test_conflicting_or_bad_parallel_settings_are_clear_errors(
    options: dict[str, Any], args: list[str], says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Settings(**options, engine_args=args)


def test_env_and_config_file_set_the_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAGATE_TENSOR_PARALLEL_SIZE", "2")
    config = tmp_path / "gateway.toml"
    config.write_text('pipeline-parallel-size = 2\ndistributed-executor-backend = "mp"\n')
    settings = load_settings(config)
    assert (settings.tensor_parallel_size, settings.pipeline_parallel_size) == (2, 2)
    assert settings.distributed_executor_backend == "mp"


runner = CliRunner()


def test_serve_takes_the_options_and_vllms_short_aliases(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def capture(config: Any, **explicit: Any) -> Any:
        seen.update(explicit)
        raise ValueError("stopped by the test")

    monkeypatch.setattr("loragate.settings.load_settings", capture)
    result = runner.invoke(
        app, ["serve", "-tp", "4", "-pp", "2", "-dp", "2", "--distributed-executor-backend", "ray"]
    )
    assert "stopped by the test" in result.output
    assert seen["tensor_parallel_size"] == 4
    assert seen["pipeline_parallel_size"] == 2
    assert seen["data_parallel_size"] == 2
    assert seen["distributed_executor_backend"] == "ray"


def test_serve_refuses_an_option_given_both_ways_differently(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["serve", "--cache-dir", str(tmp_path), "--tensor-parallel-size", "2", "--", "-tp", "4"],
    )
    assert result.exit_code == 2
    assert "--tensor-parallel-size is 2 but the engine arguments after `--` say -tp 4" in (
        " ".join(result.output.split())
    )


# ----- how many workers run on this node ----------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "workers"),
    [
        (layout(tp=4), 4),
        (layout(tp=2, pp=2), 4),
        (layout(tp=2, dp=2), 4),  # data parallel on one node: every replica here
        (layout("--nnodes", "2", tp=2, dp=2), 2),  # vLLM splits the world over the nodes
        (layout("-dpl", "1", tp=2, dp=4), 2),  # --data-parallel-size-local replicas here
        (layout("--data-parallel-size-local", "0", dp=2), 0),  # an API-server-only node
    ],
)
def test_local_workers_follow_vllms_arithmetic(plan: ParallelLayout, workers: int) -> None:
    assert plan.local_workers == workers


# ----- the preflight against faked GPUs -----------------------------------------------------


def test_too_few_gpus_names_the_numbers_and_the_gpus() -> None:
    [problem] = gpu_problems(layout(tp=4), gpus(2))
    assert problem.check == "parallel"
    assert problem.message.startswith(
        f"--tensor-parallel-size 4 needs 4 GPUs; this machine has 2 ({H100}, {H100}): "
    )


def test_data_parallel_replicas_on_one_node_count_against_its_gpus() -> None:
    [problem] = gpu_problems(layout(tp=2, dp=2), gpus(2))
    assert problem.message.startswith(
        "--tensor-parallel-size 2 x --data-parallel-size 2 needs 4 GPUs; this machine has 2"
    )
    assert gpu_problems(layout("--nnodes", "2", tp=2, dp=2), gpus(2)) == []
    assert gpu_problems(layout("-dpl", "1", tp=2, dp=2), gpus(2)) == []


def test_cuda_visible_devices_is_named_when_it_hides_gpus() -> None:
    [problem] = gpu_problems(layout(pp=2), gpus(1), CUDA_VISIBLE_DEVICES="3")
    assert "needs 2 GPUs; this machine has 1 visible (CUDA_VISIBLE_DEVICES=3)" in problem.message


def test_enough_gpus_pass() -> None:
    assert gpu_problems(layout(tp=2, pp=2), gpus(4)) == []
    assert gpu_problems(layout(), gpus(1)) == []


def test_ray_with_a_cluster_to_join_may_use_other_machines_gpus() -> None:
    assert gpu_problems(layout(tp=8, backend="ray"), gpus(2), RAY_ADDRESS="10.0.0.1:6379") == []
    # Without one, ray.init() starts a cluster of this machine alone.
    assert len(gpu_problems(layout(tp=8, backend="ray"), gpus(2))) == 1


def test_too_little_memory_per_gpu_names_the_split_and_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = sparse_model(tmp_path / "model", 100 * GiB)
    inventory = [*gpus(1, free_gib=60), GpuInfo("1", H100, 80 * GiB, 30 * GiB)]
    with pytest.raises(PreflightError) as raised:
        check_resolved_model(
            layout(tp=2), engine_python=sys.executable, model_dir=model, dtype_bytes=2,
            cpu_build=False, gpu_inventory=lambda: inventory,
        )  # fmt: skip
    [problem] = raised.value.problems
    assert problem.check == "memory"
    assert problem.message.startswith(
        "model needs 50.8 GiB on each of the 2 GPUs --tensor-parallel-size 2 spreads it over "
        f"(the tightest: GPU 1 ({H100}, 80.0 GiB, 30.0 GiB free)): its part (50.0 GiB) of "
        "100.0 GiB of bfloat16 weights at 2 bytes per parameter"
    )
    assert "it needs 2 GPUs with 51.2 GiB free each" in problem.message


def test_enough_memory_once_split_over_more_gpus_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = sparse_model(tmp_path / "model", 100 * GiB)
    check_resolved_model(
        layout(tp=4), engine_python=sys.executable, model_dir=model, dtype_bytes=2,
        cpu_build=False, gpu_inventory=lambda: gpus(4, free_gib=30),
    )  # fmt: skip


def test_ray_missing_from_the_engine_python_is_refused() -> None:
    if _has_ray(sys.executable):
        pytest.skip("this Python has ray")
    [problem] = check_parallel(
        layout(backend="ray"), "gpu", gpus(1), engine_python=sys.executable,
        numa_nodes=lambda: 1, env={},
    )  # fmt: skip
    assert problem.message == (
        f"--distributed-executor-backend ray needs Ray in the engine Python {sys.executable}, "
        f"which does not have it: install it with `{sys.executable} -m pip install ray`, or use "
        "--distributed-executor-backend mp (the GPUs of this machine only)."
    )


def test_ray_in_the_engine_python_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the probe runs the engine's Python
    problems = check_parallel(
        layout(backend="ray"), "gpu", gpus(1), engine_python=sys.executable,
        numa_nodes=lambda: 1, env={},
    )  # fmt: skip
    assert problems == []


def _has_ray(python: str) -> bool:
    import subprocess

    probe = "import importlib.util,sys; sys.exit(importlib.util.find_spec('ray') is None)"
    return subprocess.run([python, "-c", probe], check=False).returncode == 0


def test_run_preflight_reports_parallel_problems_from_its_inventory(tmp_path: Path) -> None:
    problems = run_preflight(
        engine_python=sys.executable, model_dir=None, dtype_bytes=2, host="127.0.0.1",
        port=find_free_port(), cache_dir=tmp_path / "cache", device="gpu",
        parallel=layout(tp=4), gpu_inventory=lambda: gpus(2), env={},
    )  # fmt: skip
    [message] = [problem.message for problem in problems if problem.check == "parallel"]
    assert message.startswith("--tensor-parallel-size 4 needs 4 GPUs; this machine has 2")


# ----- what vLLM's CPU build cannot do ------------------------------------------------------


def test_cpu_build_refuses_ray() -> None:
    [message] = cpu_problems(layout(backend="ray"))
    assert message.startswith(
        "vLLM's CPU build cannot run --distributed-executor-backend ray (its CPU platform has "
        "no Ray device type"
    )
    [message] = cpu_problems(layout("--data-parallel-backend", "ray", dp=1))
    assert "cannot run --data-parallel-backend ray" in message


def test_cpu_build_refuses_more_workers_than_numa_nodes() -> None:
    [message] = cpu_problems(layout(tp=2), numa=1)
    assert message.startswith(
        "--tensor-parallel-size 2 runs 2 CPU workers, and vLLM's CPU build binds each to a "
        "NUMA node of its own; this machine has 1 NUMA node: "
    )
    assert "VLLM_CPU_OMP_THREADS_BIND" in message


def test_cpu_build_runs_one_worker_per_numa_node_or_a_manual_binding() -> None:
    assert cpu_problems(layout(tp=2), numa=2) == []
    assert cpu_problems(layout(tp=2, pp=2), numa=1, VLLM_CPU_OMP_THREADS_BIND="0|1|2|3") == []
    assert cpu_problems(layout(tp=2), numa=1, VLLM_CPU_SIM_MULTI_NUMA="1") == []
    assert cpu_problems(layout(backend="mp")) == []


def test_cpu_build_refusal_reaches_the_boot_check(tmp_path: Path) -> None:
    model = sparse_model(tmp_path / "model", GiB)
    with pytest.raises(PreflightError, match="vLLM's CPU build cannot run"):
        check_resolved_model(
            layout(backend="ray"), engine_python=sys.executable, model_dir=model,
            dtype_bytes=2, cpu_build=True,
        )  # fmt: skip


async def test_a_refused_layout_is_the_reason_health_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model resolved at start-up (not seen by the command line's preflight) is checked
    before the engine boots, and /health says why it will not."""
    from loragate.serving.model import ModelRuntime
    from tools.bench.targets import write_fake_model

    monkeypatch.setattr("loragate.plan.engine_plan.is_cpu_build", lambda python: True)
    settings = Settings(
        model=str(write_fake_model(tmp_path / "model")), cache_dir=tmp_path / "cache",
        distributed_executor_backend="ray", tool_call_parser="none", cpu_lora_ops=False,
        engine_args=["--kv-cache-memory-bytes", "1073741824"],
    )  # fmt: skip
    backend = ModelRuntime(settings)

    async def no_engine() -> None:
        raise AssertionError("the engine was started despite the refusal")

    monkeypatch.setattr(backend.supervisor, "start", no_engine)
    await backend._bootstrap()
    healthy, body = backend.health()
    assert not healthy
    assert body["status"] == "failed"
    assert "vLLM's CPU build cannot run --distributed-executor-backend ray" in body["reason"]
