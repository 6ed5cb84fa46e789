"""``gateway plan``: its JSON contract and its table, the GPUs it reads (described with --gpu,
or nvidia-smi's, MIG slices and unified memory included), and ``gateway serve`` refusing with
the plan's own reason."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from loragate.cli import app
from loragate.plan.preflight.machine import visible_gpus
from tests.model_shapes import QWEN3_4B, QWEN25_1_5B, model_dir
from tests.unit.test_preflight import fake_nvidia_smi

runner = CliRunner()
GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LORAGATE_CONFIG", "LORAGATE_MODEL", "LORAGATE_MODELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAGATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    model_dir(root / "qwen3-4b", QWEN3_4B)
    model_dir(root / "alpha", QWEN25_1_5B)
    model_dir(root / "beta", QWEN25_1_5B)
    return root


def plan_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(app, ["plan", "--json", *args])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def test_json_has_the_contracts_keys_for_a_catalog(models: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        textwrap.dedent(f"""\
            max_loaded_models: 2
            models:
              alpha:
                model: {models / "alpha"}
              beta:
                model: {models / "beta"}
                devices: [0]
            """)
    )
    code, report = plan_json("--config", str(config), "--gpu", "24GiB:23GiB")
    assert code == 0
    assert report["resident_at_once"] == ["alpha", "beta"]
    keys = {"model", "fits", "reason", "devices", "gpu_memory_utilization", "weights_bytes",
            "kv_cache_bytes", "max_model_len", "argv"}  # fmt: skip
    for engine in report["engines"]:
        assert keys <= engine.keys()
        assert engine["fits"] is True and engine["reason"] is None and engine["devices"] == [0]
        assert engine["max_model_len"] == 32768
        assert "--gpu-memory-utilization" in engine["argv"]
    shares = sum(engine["gpu_memory_utilization"] for engine in report["engines"])
    assert shares <= 23 / 24
    assert [gpu["total_bytes"] for gpu in report["gpus"]] == [24 * GiB]


def test_a_refusal_exits_1_with_the_reason_and_the_table_fits_80_columns(models: Path) -> None:
    code, report = plan_json(str(models / "qwen3-4b"), "--gpu", "8GiB:7GiB")
    assert code == 1
    [engine] = report["engines"]
    assert engine["fits"] is False and engine["reason"].startswith("qwen3-4b needs 14.4 GiB")
    table = runner.invoke(app, ["plan", str(models / "qwen3-4b"), "--gpu", "8GiB:7GiB"])
    assert table.exit_code == 1
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["GPU", "TOTAL", "FREE", "RESIDENT", "NAME"]
    assert "MODEL     FITS  GPUS  SHARE  WEIGHTS  KV CACHE  MAX LEN" in lines
    assert "resident at once: none" in lines
    assert max(len(line) for line in lines) <= 80
    assert " ".join(" ".join(lines).split()).count("--max-model-len 7424") == 1


def test_engine_arguments_after_the_separator_are_planned(models: Path) -> None:
    args = ["--gpu", "8GiB:7GiB", "--", "--quantization", "fp8", "--max-model-len", "4096"]
    code, report = plan_json("--model", str(models / "qwen3-4b"), *args)
    [engine] = report["engines"]
    assert code == 0 and engine["fits"] is True
    assert engine["gpu_memory_utilization"] <= 7 / 8
    assert engine["argv"][-4:] == ["--quantization", "fp8", "--max-model-len", "4096"]


def test_the_table_shows_a_warning_the_json_carries(models: Path) -> None:
    """A share of the user's own that vLLM may yet refuse: warned about beneath its row."""
    args = [str(models / "alpha"), "--gpu", "24564MiB:24210MiB"]
    code, report = plan_json(*args, "--", "--gpu-memory-utilization", "0.97")
    [engine] = report["engines"]
    assert code == 0 and engine["fits"] is True and engine["warnings"]
    table = runner.invoke(app, ["plan", *args, "--", "--gpu-memory-utilization", "0.97"])
    assert table.exit_code == 0, table.output
    assert "--gpu-memory-utilization 0.97 asks vLLM for" in " ".join(table.stdout.split())


@pytest.mark.parametrize("value", ["8GiB:9GiB", "lots", "8GiB:0"])
def test_a_wrong_gpu_description_is_a_usage_error(models: Path, value: str) -> None:
    result = runner.invoke(app, ["plan", str(models / "alpha"), "--gpu", value])
    assert result.exit_code == 2
    assert f"--gpu {value}" in result.output


def test_a_hub_id_not_in_the_cache_is_not_guessed_offline(tmp_path: Path) -> None:
    code, report = plan_json("--model", "Org/Not-Cached-7B", "--gpu", "24GiB")
    [engine] = report["engines"]
    assert code == 0 and engine["fits"] is None
    assert engine["reason"].startswith("cannot tell: Org/Not-Cached-7B is not in the Hugging Face")


def test_a_hub_model_is_planned_from_its_fetched_headers(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's config.json and safetensors headers (no weights) plan a model as its files
    would: stood in for here by the local directory's."""
    from types import SimpleNamespace

    import huggingface_hub

    from loragate.plan.gpu.serve_plan import planning_dir
    from loragate.plan.preflight.model_files import safetensors_header

    local = models / "alpha"
    header = safetensors_header(local / "model.safetensors") or {}
    tensors = {
        name: SimpleNamespace(dtype=t["dtype"], shape=t["shape"], data_offsets=t["data_offsets"])
        for name, t in header.items()
        if name != "__metadata__"
    }

    def download(repo: str, name: str, local_dir: Path, token: Any = None) -> str:
        if not (local / name).is_file():
            raise FileNotFoundError(name)
        (Path(local_dir) / name).write_bytes((local / name).read_bytes())
        return str(Path(local_dir) / name)

    class Api:
        def get_safetensors_metadata(self, repo: str, token: Any = None) -> Any:
            files = {"model.safetensors": SimpleNamespace(tensors=tensors)}
            return SimpleNamespace(files_metadata=files)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr("loragate.plan.gpu.serve_plan._hub_snapshot", lambda *_: None)
    shapes = planning_dir("Qwen/Qwen2.5-1.5B-Instruct", tmp_path / "cache")
    assert isinstance(shapes, Path) and shapes.name == "Qwen--Qwen2.5-1.5B-Instruct"
    assert (shapes / "model.safetensors").stat().st_size < 1 << 20  # the header alone
    monkeypatch.setattr("loragate.plan.gpu.serve_plan.planning_dir", lambda *_, **__: shapes)
    _, fetched = plan_json("--model", "Qwen/Qwen2.5-1.5B-Instruct", "--gpu", "24GiB")
    _, on_disk = plan_json("--model", str(local), "--gpu", "24GiB")
    for key in ("weights_bytes", "kv_cache_bytes", "gpu_memory_utilization", "max_model_len"):
        assert fetched["engines"][0][key] == on_disk["engines"][0][key]


EIGHT_SEVEN_GPU = "echo '0, GPU-cccc-3333, NVIDIA GeForce RTX 4060, 8192, 7168'\n"


def test_serve_refuses_with_the_plans_reason(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loragate.plan.engine_plan import check_before_start
    from loragate.plan.preflight.problem import PreflightError
    from loragate.settings import Settings

    fake_nvidia_smi(tmp_path / "bin", monkeypatch, EIGHT_SEVEN_GPU)
    # This venv has vLLM's CPU build; the GPU build is what a GPU machine has.
    monkeypatch.setattr("loragate.plan.preflight.engine_builds", lambda _: {"vllm"})
    _, report = plan_json("--model", str(models / "qwen3-4b"), "--port", "0")
    [engine] = report["engines"]
    settings = Settings(model=str(models / "qwen3-4b"), port=0, cache_dir=tmp_path / "c")
    with pytest.raises(PreflightError) as refused:
        check_before_start(settings)
    assert [problem.message for problem in refused.value.problems] == [engine["reason"]]


MIG_SMI = """\
case "$1" in
  -L)
    echo "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa-1111)"
    echo "  MIG 3g.40gb     Device  0: (UUID: MIG-1111-aaaa)"
    echo "  MIG 3g.40gb     Device  1: (UUID: MIG-2222-bbbb)"
    ;;
  -q)
    cat <<'XML'
<?xml version="1.0" ?>
<nvidia_smi_log><gpu id="00000000:07:00.0"><uuid>GPU-aaaa-1111</uuid><mig_devices>
<mig_device><index>0</index><fb_memory_usage><total>40192 MiB</total><reserved>0 MiB</reserved>
<used>37 MiB</used><free>40155 MiB</free></fb_memory_usage></mig_device>
<mig_device><index>1</index><fb_memory_usage><total>40192 MiB</total><reserved>0 MiB</reserved>
<used>10037 MiB</used><free>30155 MiB</free></fb_memory_usage></mig_device>
</mig_devices></gpu></nvidia_smi_log>
XML
    ;;
  *) echo '0, GPU-aaaa-1111, NVIDIA A100-SXM4-80GB, 81920, 81000' ;;
esac
"""


def test_mig_slices_are_planned_with_their_own_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, MIG_SMI)
    gpus = visible_gpus()
    assert gpus is not None
    assert [(g.index, g.total_bytes, g.free_bytes, g.uuid) for g in gpus] == [
        ("0:0", 40192 * MiB, 40155 * MiB, "MIG-1111-aaaa"),
        ("0:1", 40192 * MiB, 30155 * MiB, "MIG-2222-bbbb"),
    ]
    assert gpus[0].name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-2222-bbbb")
    assert [g.uuid for g in visible_gpus() or []] == ["MIG-2222-bbbb"]


def test_a_mig_slice_without_readable_memory_is_listed_and_its_plan_cannot_tell(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loragate.plan.preflight import run_preflight

    fake_nvidia_smi(tmp_path / "bin", monkeypatch, MIG_SMI.replace("<index>1</index>", "<i/>"))
    gpus = visible_gpus() or []
    assert [(g.uuid, g.memory_known) for g in gpus] == [
        ("MIG-1111-aaaa", True),
        ("MIG-2222-bbbb", False),  # listed, its memory unknown, never its whole GPU's
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-2222-bbbb")
    code, report = plan_json(str(models / "qwen3-4b"))
    [engine] = report["engines"]
    assert code == 0 and engine["fits"] is None
    assert engine["reason"].startswith(
        "cannot tell whether qwen3-4b fits: nvidia-smi does not say how much memory GPU 0 "
        "(MIG 3g.40gb of GPU 0) has"
    )
    assert report["gpus"][0]["total_bytes"] is None and report["gpus"][0]["free_bytes"] is None
    # serve's preflight starts it (vLLM then sizes it), as it did before the plan existed.
    monkeypatch.setattr("loragate.plan.preflight.engine_builds", lambda _: {"vllm"})
    problems = run_preflight(
        engine_python=sys.executable,
        model_dir=models / "qwen3-4b",
        dtype_bytes=2,
        host="127.0.0.1",
        port=0,
        cache_dir=tmp_path / "cache",
        device="gpu",
    )
    assert [p.message for p in problems if p.check in ("accelerator", "memory")] == []


def test_tensor_parallelism_is_never_spread_over_mig_slices(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loragate.engine_flags import ParallelLayout
    from loragate.plan.gpu.serve_plan import plan_one
    from loragate.plan.preflight import run_preflight

    fake_nvidia_smi(tmp_path / "bin", monkeypatch, MIG_SMI)
    gpus = visible_gpus() or []
    assert len(gpus) == 2 and all(gpu.is_mig for gpu in gpus)
    placement = plan_one(models / "alpha", gpus, ParallelLayout(tensor=2))
    assert placement.fits is False
    assert "MIG slices cannot be among them: CUDA shows a process one MIG slice at most" in (
        placement.reason or ""
    )
    assert plan_one(models / "alpha", gpus, ParallelLayout()).fits is True  # one slice is fine
    monkeypatch.setattr("loragate.plan.preflight.engine_builds", lambda _: {"vllm"})
    problems = run_preflight(
        engine_python=sys.executable,
        model_dir=models / "alpha",
        dtype_bytes=2,
        host="127.0.0.1",
        port=0,
        cache_dir=tmp_path / "cache",
        device="gpu",
        parallel=ParallelLayout(tensor=2),
    )
    [message] = [p.message for p in problems if p.check in ("parallel", "memory")]
    assert "CUDA shows a process one MIG slice at most" in message


TWO_24_GIB_GPUS = (
    "echo '0, GPU-aaaa-1111, NVIDIA RTX A5000, 24564, 24000'\n"
    "echo '1, GPU-bbbb-2222, NVIDIA GeForce RTX 4090, 24564, 24000'\n"
)


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, "GPU-aaaa-1111"), ("1", "1"), ("1,0", "1"), ("GPU-bbbb", "GPU-bbbb")],
)
def test_the_engine_gets_the_users_own_cuda_visible_devices_entry(
    models: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    visible: str | None,
    expected: str,
) -> None:
    """An index in CUDA_VISIBLE_DEVICES means what CUDA's device order (FASTEST_FIRST unless
    CUDA_DEVICE_ORDER says otherwise) makes it mean, which need not be nvidia-smi's (PCI bus)
    order: the engine gets the user's entry back, not a UUID that may name another GPU."""
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, TWO_24_GIB_GPUS)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    _, report = plan_json(str(models / "alpha"))
    [engine] = report["engines"]
    assert engine["fits"] is True and engine["devices"] == [0]
    assert engine["env"] == {"CUDA_VISIBLE_DEVICES": expected}


def test_a_unified_memory_gpu_plans_with_the_hosts_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(
        tmp_path / "bin", monkeypatch, "echo '0, GPU-dddd, NVIDIA GB10, [N/A], [N/A]'\n"
    )
    [gpu] = visible_gpus() or []
    assert gpu.total_bytes == psutil.virtual_memory().total and gpu.note == "unified memory"


def test_a_catalog_refusal_says_where_its_flags_go(models: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"models:\n  big:\n    model: {models / 'qwen3-4b'}\n")
    code, report = plan_json("--config", str(config), "--gpu", "8GiB:7GiB")
    [engine] = report["engines"]
    assert code == 1
    assert engine["reason"].endswith(
        "It fits with --quantization fp8_per_tensor --max-model-len 7424 (in "
        "models.big.engine_args, or after -- for every model)."
    )


def test_without_a_gpu_it_plans_the_cpu_builds_host_memory(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, "exit 9\n")  # no driver, no GPU
    _, report = plan_json(str(models / "alpha"))
    [engine] = report["engines"]
    assert report["gpus"] == [] and report["host_bytes"] > 0
    assert engine["devices"] == [] and engine["gpu_memory_utilization"] is None
    if engine["fits"]:
        assert engine["args"] == ["--kv-cache-memory-bytes", str(engine["kv_cache_bytes"])]
    else:
        assert "--max-model-len" in engine["reason"] or "smaller model" in engine["reason"]
