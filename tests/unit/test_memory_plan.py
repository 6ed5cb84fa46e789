"""The start-up memory plan against faked GPUs (a stand-in ``nvidia-smi`` on PATH) and model
directories whose safetensors files are real headers over holes: a 4B checkpoint's tensor
names, dtypes and shapes, without 8 GB of weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loragate.engine_flags import ParallelLayout
from loragate.plan.preflight.machine import GpuInfo, visible_gpus
from loragate.plan.preflight.memory import (
    MemoryPlan,
    check_gpu_memory,
    check_memory,
    memory_plan,
    served_dtype,
)
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
    problem = check_gpu_memory(model, 2, gpus, ParallelLayout(), engine_args=list(engine_args))
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
    assert plan.fits(eight_gb_gpu)
    assert gpu_check(model, eight_gb_gpu, "--quantization", "fp8") is None
    assert gpu_check(model, eight_gb_gpu, "--quantization=fp8_per_block") is None


def test_bf16_4b_alone_is_refused_with_the_plans_numbers(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = plan_of(model)
    parameters = LINEAR_PARAMETERS + EMBEDDING_PARAMETERS + NORM_PARAMETERS
    assert plan.weights_bytes == 2 * parameters
    assert plan.need_per_gpu == plan.weights_bytes + int(plan.weights_bytes * 0.1) + GiB
    message = gpu_check(model, eight_gb_gpu)
    assert message == (
        f"{plan.describe()} but vLLM may take only 7.2 GiB of {ON_IT} (0.9 of its 8.0 GiB, "
        "--gpu-memory-utilization): pick a smaller or quantized model, or quantize it as it "
        "loads (--quantization fp8_per_tensor after --), or spread it over GPUs with "
        "--tensor-parallel-size N."
    )
    assert plan.describe() == (
        f"The model in {model} needs about 9.2 GiB (7.5 GiB of bfloat16 weights at 2 bytes per "
        "parameter, plus 1.7 GiB of headroom)"
    )


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
    assert gpu_check(model, eight_gb_gpu) is None
    # The checkpoint's own quantization wins over a --quantization that would cast it again.
    assert plan_of(model, "--quantization", "fp8").weights_bytes == plan.weights_bytes


def test_kv_cache_memory_bytes_is_added_to_the_need(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    without = plan_of(model, "--quantization", "fp8")
    with_kv = plan_of(model, "--quantization", "fp8", "--kv-cache-memory-bytes", "3G")
    assert with_kv.kv_cache_bytes == 3 * GiB
    assert with_kv.need_per_gpu == without.need_per_gpu + 3 * GiB
    message = gpu_check(model, eight_gb_gpu, "--quantization", "fp8", "--kv-cache-memory-bytes=3G")
    assert message is not None
    assert message.startswith(with_kv.describe() + " but only 7.6 GiB of free GPU memory")
    assert "and 3.0 GiB of KV cache (--kv-cache-memory-bytes))" in message
    assert "lower --kv-cache-memory-bytes, free some memory" in message


def test_kv_cache_memory_bytes_sets_aside_the_utilization_share(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    # vLLM ignores --gpu-memory-utilization when --kv-cache-memory-bytes sizes the cache: the
    # 7.4 GiB needed exceeds the 0.9 share (7.2 GiB) but fits the 7.6 GiB free.
    model = bf16_4b(tmp_path / "qwen3-4b")
    args = ("--quantization", "fp8", "--kv-cache-memory-bytes", "1900M")
    plan = plan_of(model, *args)
    [gpu] = eight_gb_gpu
    assert gpu.total_bytes * 0.9 < plan.need_per_gpu <= gpu.free_bytes
    assert gpu_check(model, eight_gb_gpu, *args) is None


def test_gpu_memory_utilization_lowers_the_room(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    args = ("--quantization", "fp8", "--gpu-memory-utilization", "0.5")
    plan = plan_of(model, *args)
    [gpu] = eight_gb_gpu
    assert plan.room_on(gpu) == int(gpu.total_bytes * 0.5)
    # The share that would hold the need, rounded up to a hundredth: 0.7 of 8188 MiB.
    assert 0.69 * gpu.total_bytes < plan.need_per_gpu <= 0.70 * gpu.total_bytes
    message = gpu_check(model, eight_gb_gpu, *args)
    assert message == (
        f"{plan.describe()} but vLLM may take only 4.0 GiB of {ON_IT} (0.5 of its 8.0 GiB, "
        "--gpu-memory-utilization): raise --gpu-memory-utilization to 0.7 after --, or pick a "
        "smaller or quantized model, or spread it over GPUs with --tensor-parallel-size N."
    )


def test_tensor_parallelism_cuts_the_planned_weights(tmp_path: Path) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = plan_of(model, "--quantization", "fp8", layout=ParallelLayout(tensor=2))
    assert plan.weights_per_gpu == math.ceil(plan.weights_bytes / 2)
    four_gb = [GpuInfo(str(i), "NVIDIA T1000", 4 * GiB, 3 * GiB) for i in range(2)]
    problem = check_gpu_memory(
        model, 2, four_gb, ParallelLayout(tensor=2), engine_args=["--quantization", "fp8"]
    )
    assert problem is not None
    assert problem.message.startswith(
        f"--tensor-parallel-size 2 cuts the model in {model} (4.1 GiB of weights: the linear "
        "layers at 1 byte per parameter by --quantization fp8, the embeddings and the rest "
        "bfloat16 at 2 bytes per parameter) into 2 parts of about 2.1 GiB, so each GPU needs "
        "about 3.3 GiB with headroom, but GPU 0 (NVIDIA T1000) has only 3.0 GiB free: "
    )


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


def test_an_unknown_quantization_method_skips_the_check(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    model = bf16_4b(tmp_path / "qwen3-4b")
    assert memory_plan(model, ["--quantization", "some_future_method"]) is None
    assert gpu_check(model, eight_gb_gpu, "-q", "some_future_method") is None


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


def test_callers_without_the_engines_flags_keep_the_free_memory_room(tmp_path: Path) -> None:
    # Without engine_args the share is unknown (the user may have raised it after --): only
    # what is free counts, as before the plan read the flags.
    model = bf16_4b(tmp_path / "qwen3-4b")
    legacy = memory_plan(model, dtype_bytes=2)
    assert legacy is not None
    assert (legacy.dtype, legacy.gpu_memory_utilization) == (None, None)
    # 9.2 GiB needed: within the 9.8 GiB free, over the default share (0.9 of 10 GiB).
    gpu = GpuInfo("0", "NVIDIA L4", 10 * GiB, 98 * GiB // 10)
    assert legacy.room_on(gpu) == gpu.free_bytes
    assert check_gpu_memory(model, 2, [gpu], ParallelLayout()) is None
    assert check_gpu_memory(model, 2, [gpu], ParallelLayout(), engine_args=[]) is not None


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
        engine_args=["--quantization", "fp8"],
    )
    with pytest.raises(PreflightError) as refused:
        check_resolved_model(
            ParallelLayout(), engine_python="python3", model_dir=model, dtype_bytes=2,
            cpu_build=False, engine_args=[],
        )  # fmt: skip
    assert plan_of(model).describe() in str(refused.value)


def test_a_catalog_counts_what_vllm_takes_of_the_gpu(
    tmp_path: Path, eight_gb_gpu: list[GpuInfo]
) -> None:
    """A catalog's budget counts each engine's GPU memory: vLLM's --gpu-memory-utilization
    share of the GPU, or, with --kv-cache-memory-bytes, the plan's need."""
    from loragate.plan.engine_plan import EnginePlan, _gpu_memory_bytes
    from loragate.settings import Settings

    model = bf16_4b(tmp_path / "qwen3-4b")
    plan = EnginePlan(model, json.loads((model / "config.json").read_text()), [], [])

    def held(*engine_args: str) -> int | None:
        return _gpu_memory_bytes(Settings(model=str(model), engine_args=list(engine_args)), plan)

    total = eight_gb_gpu[0].total_bytes
    assert held("--quantization", "fp8") == int(0.9 * total)
    assert held("--quantization", "fp8", "--gpu-memory-utilization", "0.45") == int(0.45 * total)
    sized = plan_of(model, "--quantization", "fp8", "--kv-cache-memory-bytes", "1g")
    assert held("--quantization", "fp8", "--kv-cache-memory-bytes", "1g") == sized.need_per_gpu
