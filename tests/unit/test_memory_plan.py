"""The memory plan's weights, and the GPU plan built on them, against faked GPUs (a stand-in
``nvidia-smi`` on PATH) and model directories whose safetensors files are real headers over
holes: a 4B checkpoint's tensor names, dtypes and shapes, without 8 GB of weights. The GPU
rules themselves (the share, one full sequence, placement) are tests/unit/test_gpu_plan.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loragate.engine_flags import ParallelLayout
from loragate.plan.gpu.serve_plan import memory_problem, plan_one
from loragate.plan.preflight.machine import GpuInfo, visible_gpus
from loragate.plan.preflight.memory import MemoryPlan, check_memory, memory_plan
from loragate.plan.preflight.model_files import served_dtype
from tests.unit.test_preflight import GiB, MiB, fake_nvidia_smi, safetensors_file

# A Qwen3-4B-shaped decoder: 36 layers, hidden 2560, 32 query and 8 KV heads of 128, tied
# embeddings over a 151936-token vocabulary: about 4.0e9 parameters.
HIDDEN, LAYERS, VOCAB, INTERMEDIATE = 2560, 36, 151936, 9728
# (name, rows out, columns in) of each layer's linear weights.
LINEAR = [
    ("self_attn.q_proj", 4096, HIDDEN),
    ("self_attn.k_proj", 1024, HIDDEN),
    ("self_attn.v_proj", 1024, HIDDEN),
    ("self_attn.o_proj", HIDDEN, 4096),
    ("mlp.gate_proj", INTERMEDIATE, HIDDEN),
    ("mlp.up_proj", INTERMEDIATE, HIDDEN),
    ("mlp.down_proj", HIDDEN, INTERMEDIATE),
]
LINEAR_PARAMETERS = LAYERS * sum(rows * columns for _, rows, columns in LINEAR)
EMBEDDING_PARAMETERS = VOCAB * HIDDEN
NORM_PARAMETERS = LAYERS * 2 * HIDDEN + HIDDEN
# An 8 GB card as nvidia-smi lists it (MiB): 7800 of its 8188 free.
EIGHT_GB_GPU = "echo '0, GPU-cccc-3333, NVIDIA GeForce RTX 4060, 8188, 7800'\n"
ON_IT = "GPU 0 (NVIDIA GeForce RTX 4060)"


def config(directory: Path, **extra: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": HIDDEN,
                "num_hidden_layers": LAYERS,
                "vocab_size": VOCAB,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "intermediate_size": INTERMEDIATE,
                "tie_word_embeddings": True,
                "max_position_embeddings": 40960,
                "torch_dtype": "bfloat16",
                **extra,
            }
        )
    )


def norms(dtype: str) -> dict[str, tuple[str, list[int], int]]:
    tensors = {"model.norm.weight": (dtype, [HIDDEN], 2 * HIDDEN)}
    for layer in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = (dtype, [HIDDEN], 2 * HIDDEN)
    return tensors


def bf16_4b(directory: Path) -> Path:
    """The float checkpoint: every tensor BF16."""
    config(directory)
    tensors = {"model.embed_tokens.weight": ("BF16", [VOCAB, HIDDEN], 2 * VOCAB * HIDDEN)}
    for layer in range(LAYERS):
        for name, rows, columns in LINEAR:
            key = f"model.layers.{layer}.{name}.weight"
            tensors[key] = ("BF16", [rows, columns], 2 * rows * columns)
    safetensors_file(directory / "model.safetensors", tensors | norms("BF16"))
    return directory


AWQ_GROUP = 128


def awq_4b(directory: Path) -> Path:
    """The same model as AutoAWQ stores it: 4-bit weights packed eight to an int32
    (``qweight`` in x out/8), int32 zero points and float16 scales per group of 128 inputs."""
    config(
        directory,
        torch_dtype="float16",
        quantization_config={
            "quant_method": "awq",
            "bits": 4,
            "group_size": AWQ_GROUP,
            "zero_point": True,
            "version": "gemm",
        },
    )
    tensors = {"model.embed_tokens.weight": ("F16", [VOCAB, HIDDEN], 2 * VOCAB * HIDDEN)}
    for layer in range(LAYERS):
        for name, out, into in LINEAR:
            key = f"model.layers.{layer}.{name}"
            groups = into // AWQ_GROUP
            tensors[f"{key}.qweight"] = ("I32", [into, out // 8], 4 * into * out // 8)
            tensors[f"{key}.qzeros"] = ("I32", [groups, out // 8], 4 * groups * out // 8)
            tensors[f"{key}.scales"] = ("F16", [groups, out], 2 * groups * out)
    safetensors_file(directory / "model.safetensors", tensors | norms("F16"))
    return directory


@pytest.fixture
def eight_gb_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[GpuInfo]:
    fake_nvidia_smi(tmp_path / "bin", monkeypatch, EIGHT_GB_GPU)
    gpus = visible_gpus()
    assert gpus == [GpuInfo("0", "NVIDIA GeForce RTX 4060", 8188 * MiB, 7800 * MiB)]
    return gpus


def plan_of(model: Path, *engine_args: str, layout: ParallelLayout | None = None) -> MemoryPlan:
    plan = memory_plan(model, list(engine_args), layout=layout)
    assert plan is not None
    return plan


def gpu_check(model: Path, gpus: list[GpuInfo], *engine_args: str) -> str | None:
    problem = memory_problem(plan_one(model, gpus, ParallelLayout(), engine_args=engine_args))
    assert problem is None or problem.check == "memory"
    return None if problem is None else problem.message


def test_bf16_4b_with_fp8_quantization_fits_an_8_gb_gpu(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = plan_of(model, "--quantization", "fp8")
    # Linear weights at 1 byte; the (tied) embedding and the norms stay bfloat16.
    assert plan.weights_bytes == LINEAR_PARAMETERS + 2 * (EMBEDDING_PARAMETERS + NORM_PARAMETERS)
    assert (plan.dtype, plan.quantization, plan.quantized_by, plan.bits) == (
        "bfloat16",
        "fp8",
        "--quantization",
        8,
    )
    assert plan.describe_weights() == (
        "4.1 GiB of weights: the linear layers at 1 byte per parameter by --quantization fp8, "
        "the embeddings and the rest bfloat16 at 2 bytes per parameter"
    )
    # At its whole 40960-token context one sequence's KV cache (5.6 GiB) does not fit too.
    assert (
        gpu_check(model, eight_gb_gpu, "--quantization", "fp8", "--max-model-len", "4096") is None
    )
    assert (
        gpu_check(model, eight_gb_gpu, "--quantization=fp8_per_block", "--max-model-len=4k") is None
    )
    assert "It fits with --max-model-len" in (gpu_check(model, eight_gb_gpu, "-q", "fp8") or "")


def test_bf16_4b_alone_is_refused_with_the_plans_numbers(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = plan_of(model)
    parameters = LINEAR_PARAMETERS + EMBEDDING_PARAMETERS + NORM_PARAMETERS
    assert plan.weights_bytes == 2 * parameters
    message = gpu_check(model, eight_gb_gpu)
    assert message is not None
    assert message.startswith(
        f"qwen3-4b needs 14.4 GiB on GPU 0 (NVIDIA GeForce RTX 4060, 8.0 GiB, 7.6 GiB free): "
        f"{plan.describe_weights()}, 5.6 GiB of KV cache for one 40960-token sequence"
    )
    assert "It fits with --quantization fp8_per_tensor --max-model-len " in message


def test_awq_4bit_checkpoint_counts_as_stored_and_fits(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = awq_4b(tmp_path / "qwen3-4b-awq")
    plan = plan_of(model)
    packed = LINEAR_PARAMETERS // 2  # the int32 qweights: eight 4-bit weights in 4 bytes
    # Per group of 128 inputs and output: half a byte of packed zero point, a 2-byte scale.
    zeros_and_scales = sum(LAYERS * (into // AWQ_GROUP) * out * 5 // 2 for _, out, into in LINEAR)
    floats = 2 * (EMBEDDING_PARAMETERS + NORM_PARAMETERS)
    assert plan.weights_bytes == packed + zeros_and_scales + floats
    assert (plan.dtype, plan.quantization, plan.quantized_by, plan.bits) == (
        "float16",
        "awq",
        "checkpoint",
        4,
    )
    assert plan.describe_weights().startswith(
        "2.5 GiB of weights: awq 4-bit as stored in the checkpoint, the float rest float16 at 2"
    )
    assert gpu_check(model, eight_gb_gpu, "--max-model-len", "8192") is None
    # vLLM refuses a --quantization other than the checkpoint's own (config/model.py:1443).
    refused = gpu_check(model, eight_gb_gpu, "--quantization", "fp8", "--max-model-len", "8192")
    assert refused == (
        "--quantization fp8: the checkpoint is already quantized with awq, and vLLM refuses a "
        "--quantization other than the checkpoint's own: drop the flag."
    )


def test_kv_cache_memory_bytes_is_the_kv_part_of_the_need(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    with_kv = plan_of(model, "--quantization", "fp8", "--kv-cache-memory-bytes", "3G")
    assert with_kv.kv_cache_bytes == 3 * GiB
    message = gpu_check(model, eight_gb_gpu, "--quantization", "fp8", "--kv-cache-memory-bytes=3G")
    assert message is not None
    assert "3.0 GiB of KV cache (--kv-cache-memory-bytes)" in message
    # 3 GiB holds a sequence of about 21,000 tokens, not the 40960 vLLM would serve.
    assert "It fits with --max-model-len" not in message or "--kv-cache-memory-bytes" in message


def test_a_given_share_below_the_need_is_refused_naming_one_that_fits(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    args = ("--quantization", "fp8", "--max-model-len", "4096", "--gpu-memory-utilization", "0.5")
    message = gpu_check(model, eight_gb_gpu, *args)
    assert message is not None
    assert "but --gpu-memory-utilization 0.5 gives it 4.0 GiB" in message
    # What is free less the CUDA context: (7800 - 512) / 8188 MiB, in thousandths.
    assert message.endswith("It fits with --gpu-memory-utilization 0.89 (after --).")
    assert gpu_check(model, eight_gb_gpu, *args[:-1], "0.89") is None
    # 0.9 x 8188 MiB is 7369 MiB, under the 7800 free: vLLM's check (share x torch's total,
    # which leaves the driver's reserve out, against what is free after its context) may
    # pass it, so it is not refused. 0.98 x 98% of 8188 MiB is more than is free: refused.
    assert gpu_check(model, eight_gb_gpu, *args[:-1], "0.9") is None
    assert "so vLLM refuses to start" in (gpu_check(model, eight_gb_gpu, *args[:-1], "0.98") or "")


def test_tensor_parallelism_cuts_the_planned_weights(tmp_path: Path) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = plan_of(model, "--quantization", "fp8", layout=ParallelLayout(tensor=2))
    assert plan.weights_per_gpu == math.ceil(plan.weights_bytes / 2)
    four_gb = [GpuInfo(str(i), "NVIDIA T1000", 4 * GiB, 3 * GiB) for i in range(2)]
    problem = memory_problem(
        plan_one(model, four_gb, ParallelLayout(tensor=2), engine_args=["--quantization", "fp8"])
    )
    assert problem is not None
    assert problem.message.startswith(
        "qwen3-4b needs 6.1 GiB on each of the 2 GPUs --tensor-parallel-size 2 spreads it over "
        "(the tightest: GPU 0 (NVIDIA T1000, 4.0 GiB, 3.0 GiB free)): its part (2.1 GiB) of "
        "4.1 GiB of weights"
    )
    # Its KV heads split too: a 40960-token sequence is 2.8 GiB on each GPU.
    assert "2.8 GiB of KV cache for one 40960-token sequence" in problem.message


def test_dtype_flag_and_vllms_auto_rule(tmp_path: Path) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    assert plan_of(model, "--dtype", "float32").weights_bytes == 2 * plan_of(model).weights_bytes
    assert plan_of(model, "--dtype=half").dtype == "float16"
    # auto serves a float32 checkpoint in 16 bits, and a 16-bit one as it is.
    assert served_dtype({"torch_dtype": "float32"}, []) == "bfloat16"
    assert served_dtype({"text_config": {"torch_dtype": "float16"}}, ["--dtype", "auto"]) == (
        "float16"
    )
    assert served_dtype({}, []) == "bfloat16"


def test_experts_only_quantization_leaves_the_dense_layers_in_bfloat16(tmp_path: Path) -> None:
    config(tmp_path)
    safetensors_file(
        tmp_path / "model.safetensors",
        {
            "model.layers.0.self_attn.q_proj.weight": ("BF16", [1024, 1024], 2 * MiB),
            "model.layers.0.mlp.experts.0.up_proj.weight": ("BF16", [1024, 1024], 2 * MiB),
            "model.layers.0.mlp.shared_expert.up_proj.weight": ("BF16", [1024, 1024], 2 * MiB),
        },
    )
    assert plan_of(tmp_path, "--quantization", "experts_int8").weights_bytes == 5 * MiB
    assert plan_of(tmp_path, "--quantization", "fp8").weights_bytes == 3 * MiB


def test_quantized_checkpoint_without_weight_files_is_estimated_at_its_bits(
    tmp_path: Path,
) -> None:
    config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    plan = plan_of(tmp_path)
    expected = 2 * EMBEDDING_PARAMETERS + LINEAR_PARAMETERS // 2
    assert plan.weights_bytes == expected
    assert plan.bits == 4


def test_a_quantization_vllm_does_not_take_is_refused(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    assert memory_plan(model, ["--quantization", "some_future_method"]) is None
    message = gpu_check(model, eight_gb_gpu, "-q", "some_future_method")
    assert message is not None
    assert message.startswith("--quantization some_future_method: vLLM 0.32.0 does not take it")


def test_host_memory_check_uses_the_plan(tmp_path: Path) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    args = ["--quantization", "fp8"]
    assert check_memory(model, 2, 6 * GiB, "cpu", engine_args=args) is None
    problem = check_memory(model, 2, 6 * GiB, "cpu", engine_args=[])
    assert problem is not None
    assert problem.message == (
        f"{plan_of(model).describe()} but only 6.0 GiB of available host memory is left: free "
        "some memory, or pick a smaller or quantized model."
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2000000000", 2_000_000_000), ("2g", 2_000_000_000), ("2G", 2 * GiB), ("1.5k", 1500)],
)
def test_kv_cache_memory_bytes_reads_vllms_suffixes(
    tmp_path: Path, value: str, expected: int
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    assert plan_of(model, "--kv-cache-memory-bytes", value).kv_cache_bytes == expected


def test_the_preflight_composition_hands_the_engine_flags_to_the_memory_plan(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    """What `gateway serve -- --quantization fp8` runs before the engine: the whole preflight,
    the engine's flags included (a bf16 4B on an 8 GB GPU: refused alone, fine with fp8)."""
    from loragate.plan.preflight import check_resolved_model
    from loragate.plan.preflight.problem import PreflightError

    model = bf16_4b(tmp_path / "qwen3-4b")
    check_resolved_model(
        ParallelLayout(),
        engine_python="python3",
        model_dir=model,
        dtype_bytes=2,
        cpu_build=False,
        engine_args=["--quantization", "fp8", "--max-model-len", "4096"],
    )
    with pytest.raises(PreflightError) as refused:
        check_resolved_model(
            ParallelLayout(), engine_python="python3", model_dir=model, dtype_bytes=2,
            cpu_build=False, engine_args=[],
        )  # fmt: skip
    assert plan_of(model).describe_weights() in str(refused.value)


async def test_the_engine_boots_with_the_plans_share_and_gpu(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs the engine gets the plan's --gpu-memory-utilization and CUDA_VISIBLE_DEVICES,
    and a catalog counts what the plan says it holds: its CUDA context and its share."""
    from loragate.plan.engine_plan import plan_engine
    from loragate.plan.preflight.problem import PreflightError
    from loragate.settings import Settings
    from loragate.supervisor.command import engine_argv, engine_env

    monkeypatch.setattr("loragate.plan.engine_plan.is_cpu_build", lambda python: False)
    model = bf16_4b(tmp_path / "qwen3-4b")
    args = ["--quantization", "fp8", "--max-model-len", "4096"]
    settings = Settings(model=str(model), engine_args=args, tool_call_parser="none")
    plan = await plan_engine(settings, tmp_path / "cache")
    assert plan.gpu is not None and plan.gpu.fits and plan.gpu.share is not None
    spec = plan.spec.for_boot(tmp_path / "engine.sock", "key", {})
    argv = engine_argv(spec)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == f"{plan.gpu.share:g}"
    assert engine_env(spec)["CUDA_VISIBLE_DEVICES"] == "GPU-cccc-3333"
    [gpu] = eight_gb_gpu
    assert plan.memory_bytes == 512 * MiB + int(gpu.total_bytes * plan.gpu.share)
    with pytest.raises(PreflightError) as refused:
        await plan_engine(Settings(model=str(model), tool_call_parser="none"), tmp_path / "cache")
    assert str(refused.value).startswith("cannot start:\n  - qwen3-4b needs 14.4 GiB on GPU 0")
