"""The GPU plan against described GPUs, with model directories shaped like Qwen3-4B and
Qwen2.5-1.5B/7B (tests/model_shapes.py: real headers over holes). Every number asserted is the
plan's own; the rules are vLLM 0.32's (loragate/plan/gpu/vllm_rules.py cites them): it refuses
to start when less than share x total is free, and unless the KV cache holds one whole
max_model_len sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from loragate.plan.gpu.need import EngineAsk
from loragate.plan.gpu.placement import GpuPlan, Placement, plan_gpus
from loragate.plan.gpu.vllm_rules import (
    CUDA_CONTEXT_BYTES,
    QUANTIZATION_METHODS_0_32,
    engine_rules,
)
from loragate.plan.preflight.machine import GpuInfo
from tests.model_shapes import QWEN3_4B, QWEN25_1_5B, QWEN25_7B, model_dir

GiB = 1 << 30
RULES = engine_rules()


def gpu(total_gib: float, free_gib: float, name: str = "NVIDIA test GPU") -> GpuInfo:
    return GpuInfo("0", name, int(total_gib * GiB), int(free_gib * GiB))


def plan(asks: list[EngineAsk], gpus: list[GpuInfo], **limits: int) -> GpuPlan:
    return plan_gpus(asks, gpus, RULES, **limits)


def one(model: Path, gpus: list[GpuInfo], *args: str) -> Placement:
    return plan([EngineAsk(model.name, model, args)], gpus).engines[0]


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("models") / "qwen3-4b", QWEN3_4B)


@pytest.fixture(scope="module")
def qwen25_1_5b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("models") / "qwen2.5-1.5b", QWEN25_1_5B)


@pytest.fixture(scope="module")
def qwen25_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("models") / "qwen2.5-7b", QWEN25_7B)


EIGHT_SEVEN = [gpu(8, 7)]  # an 8 GiB card with 7 GiB free


def test_the_fixture_costs_no_disk_and_has_the_real_parameter_count(qwen3_4b: Path) -> None:
    weights = qwen3_4b / "model.safetensors"
    assert weights.stat().st_size > 8 * 10**9  # as big as the real bfloat16 file...
    assert weights.stat().st_blocks * 512 < 1 << 20  # ...and nothing of it on disk
    assert 4.0e9 < QWEN3_4B.parameters() < 4.05e9
    assert QWEN3_4B.kv_bytes_per_token == 144 * 1024  # 36 layers x 8 KV heads x 128 x 2 x 2


def test_qwen3_4b_bf16_on_8_gib_with_7_free_is_refused_with_what_fits(qwen3_4b: Path) -> None:
    placement = one(qwen3_4b, EIGHT_SEVEN)
    assert placement.fits is False
    assert placement.weights_bytes == 2 * QWEN3_4B.parameters()
    assert placement.one_sequence_kv_bytes == 40960 * 144 * 1024  # 5.6 GiB for one sequence
    reason = placement.reason or ""
    assert reason.startswith(
        "qwen3-4b needs 14.4 GiB on GPU 0 (NVIDIA test GPU, 8.0 GiB, 7.0 GiB free): 7.5 GiB "
        "of bfloat16 weights at 2 bytes per parameter, 5.6 GiB of KV cache for one "
        "40960-token sequence"
    )
    assert "vLLM may take at most 6.5 GiB there" in reason
    assert reason.endswith(
        "It fits with --quantization fp8_per_tensor --max-model-len 7424 (after --)."
    )
    # What it names fits, and the plan says so.
    fixed = one(
        qwen3_4b, EIGHT_SEVEN, "--quantization", "fp8_per_tensor", "--max-model-len", "7424"
    )
    assert fixed.fits is True


def test_fp8_at_the_full_context_is_refused_naming_max_model_len(qwen3_4b: Path) -> None:
    placement = one(qwen3_4b, EIGHT_SEVEN, "--quantization", "fp8")
    assert placement.fits is False
    assert placement.max_model_len == 40960
    assert "5.6 GiB of KV cache for one 40960-token sequence" in (placement.reason or "")
    assert (placement.reason or "").endswith("It fits with --max-model-len 7424 (after --).")


def test_fp8_at_4096_fits_with_a_share_within_free_and_holding_weights_and_kv(
    qwen3_4b: Path,
) -> None:
    [card] = EIGHT_SEVEN
    placement = one(qwen3_4b, EIGHT_SEVEN, "--quantization", "fp8", "--max-model-len", "4096")
    assert placement.fits is True and placement.reason is None
    assert placement.devices == [0] and placement.max_model_len == 4096
    share = placement.share or 0
    # vLLM's start-up check: share x total is free when the engine starts, its context aside.
    assert share * card.total_bytes <= card.free_bytes - CUDA_CONTEXT_BYTES
    assert share <= card.free_bytes / card.total_bytes
    # And the share holds the weights and at least one 4096-token sequence of KV cache.
    weights, kv = placement.weights_bytes or 0, placement.kv_cache_bytes or 0
    assert kv >= placement.one_sequence_kv_bytes == 4096 * 144 * 1024
    assert weights + kv <= share * card.total_bytes
    assert placement.args == ["--gpu-memory-utilization", f"{share:g}"]
    assert placement.argv[:2] == ["--model", str(qwen3_4b)]
    assert placement.argv[-6:] == [*placement.args, "--quantization", "fp8", "--max-model-len", "4096"]  # fmt: skip


def test_two_1_5b_models_are_resident_on_one_24_gib_gpu(qwen25_1_5b: Path) -> None:
    card = gpu(24, 23)
    asks = [EngineAsk("alpha", qwen25_1_5b), EngineAsk("beta", qwen25_1_5b)]
    result = plan(asks, [card])
    assert result.resident_at_once == ["alpha", "beta"]
    alpha, beta = result.engines
    assert alpha.devices == beta.devices == [0]
    shares = (alpha.share or 0) + (beta.share or 0)
    # Each boots while the other holds its share and context: together within what is free.
    assert shares * card.total_bytes + 2 * CUDA_CONTEXT_BYTES <= card.free_bytes
    assert shares <= card.free_bytes / card.total_bytes
    for engine in (alpha, beta):
        assert engine.fits and engine.resident
        assert (engine.kv_cache_bytes or 0) >= (engine.one_sequence_kv_bytes or 0)
        assert (engine.need_bytes or 0) <= (engine.share or 0) * card.total_bytes


def test_two_7b_models_on_two_24_gib_gpus_get_one_gpu_each(qwen25_7b: Path) -> None:
    cards = [gpu(24, 23), GpuInfo("1", "NVIDIA test GPU", 24 * GiB, 23 * GiB)]
    result = plan([EngineAsk("alpha", qwen25_7b), EngineAsk("beta", qwen25_7b)], cards)
    assert result.resident_at_once == ["alpha", "beta"]
    alpha, beta = result.engines
    assert (alpha.devices, beta.devices) == ([0], [1])
    assert alpha.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert beta.env == {"CUDA_VISIBLE_DEVICES": "1"}
    for engine, card in ((alpha, cards[0]), (beta, cards[1])):
        assert (engine.share or 0) * card.total_bytes + CUDA_CONTEXT_BYTES <= card.free_bytes
        assert (engine.kv_cache_bytes or 0) >= 32768 * QWEN25_7B.kv_bytes_per_token


def test_small_models_fill_one_gpu_and_leave_the_other_to_a_big_one(
    qwen25_1_5b: Path, qwen25_7b: Path
) -> None:
    cards = [gpu(24, 23), GpuInfo("1", "NVIDIA test GPU", 24 * GiB, 23 * GiB)]
    asks = [EngineAsk("support", qwen25_1_5b), EngineAsk("triage", qwen25_1_5b),
            EngineAsk("writer", qwen25_7b)]  # fmt: skip
    result = plan(asks, cards)
    assert result.resident_at_once == ["support", "triage", "writer"]
    assert [engine.devices for engine in result.engines] == [[1], [1], [0]]


def test_two_7b_models_on_one_gpu_take_turns(qwen25_7b: Path) -> None:
    result = plan([EngineAsk("alpha", qwen25_7b), EngineAsk("beta", qwen25_7b)], [gpu(24, 23)])
    assert result.resident_at_once == ["alpha"]
    beta = result.engines[1]
    assert beta.fits and not beta.resident and beta.devices == [0]  # it swaps with alpha


def test_bitsandbytes_is_refused_naming_what_the_installed_vllm_takes(qwen3_4b: Path) -> None:
    placement = one(qwen3_4b, EIGHT_SEVEN, "--quantization", "bitsandbytes")
    assert placement.fits is False
    reason = placement.reason or ""
    assert reason.startswith("--quantization bitsandbytes: vLLM 0.32.0 does not take it")
    assert f"it takes {', '.join(RULES.quantization)}." in reason
    assert "fp8_per_tensor" in RULES.quantization and "bitsandbytes" not in RULES.quantization
    assert "ptpc_fp8" not in RULES.quantization
    assert reason.endswith("It fits with --quantization fp8_per_tensor --max-model-len 7424 (after --).")  # fmt: skip
    assert "ptpc_fp8: vLLM 0.32.0 does not take it" in (
        one(qwen3_4b, EIGHT_SEVEN, "-q", "ptpc_fp8").reason or ""
    )


def test_the_accepted_methods_are_read_from_the_installed_vllm_without_importing_it() -> None:
    import subprocess

    probe = (
        "import sys\nfrom loragate.plan.gpu.vllm_rules import engine_rules\n"
        "rules = engine_rules()\nprint(rules.source)\nprint('vllm' in sys.modules, "
        "'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    source, imported = done.stdout.splitlines()
    assert source.endswith("vllm/model_executor/layers/quantization/__init__.py")
    assert imported == "False False"
    assert RULES.quantization == QUANTIZATION_METHODS_0_32  # this venv has vLLM 0.32.0
    assert RULES.default_share == 0.92  # vllm/config/cache.py:102


def test_another_engine_pythons_vllm_is_read_and_a_missing_one_falls_back(tmp_path: Path) -> None:
    package = tmp_path / "site" / "vllm"
    (package / "model_executor/layers/quantization").mkdir(parents=True)
    (package / "config").mkdir()
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text("__version__ = version = '0.99.0'\n")
    (package / "model_executor/layers/quantization/__init__.py").write_text(
        'QuantizationMethods = Literal[\n    "awq",\n    "bitsandbytes",\n]\n'
    )
    (package / "config/cache.py").write_text(
        "class CacheConfig:\n    gpu_memory_utilization: float = Field(default=0.8, gt=0)\n"
    )
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho {package / '__init__.py'}\n")
    python.chmod(0o755)
    rules = engine_rules(str(python))
    assert (rules.quantization, rules.default_share, rules.version) == (
        ("awq", "bitsandbytes"), 0.8, "0.99.0"
    )  # fmt: skip
    nothing = tmp_path / "bare"
    nothing.write_text("#!/bin/sh\necho\n")
    nothing.chmod(0o755)
    assert engine_rules(str(nothing)).quantization == QUANTIZATION_METHODS_0_32


def test_kv_cache_memory_bytes_does_not_lift_the_share_check(qwen3_4b: Path) -> None:
    [card] = EIGHT_SEVEN
    args = ("-q", "fp8", "--max-model-len", "4096", "--kv-cache-memory-bytes", "1G")
    placement = one(qwen3_4b, EIGHT_SEVEN, *args)
    assert placement.fits and placement.kv_cache_bytes == GiB
    # vLLM still checks share x total against what is free: its default 0.92 is not.
    assert (placement.share or 1) * card.total_bytes <= card.free_bytes - CUDA_CONTEXT_BYTES
    assert placement.args == ["--gpu-memory-utilization", f"{placement.share:g}"]


def test_a_share_above_what_is_free_is_refused_naming_one_that_fits(qwen3_4b: Path) -> None:
    args = ("-q", "fp8", "--max-model-len", "4096", "--gpu-memory-utilization", "0.9")
    placement = one(qwen3_4b, EIGHT_SEVEN, *args)
    assert placement.fits is False
    # vLLM's own check, the driver's reserve at its largest and no CUDA context: 0.9 x 98% of
    # 8 GiB is more than the 7 GiB free.
    assert (
        "--gpu-memory-utilization 0.9 asks vLLM for 7.2 GiB (at least 7.1 GiB of the total "
        "torch counts, which leaves out what the driver keeps back) and only 7.0 GiB is free "
        "there, so vLLM refuses to start"
    ) in (placement.reason or "")
    assert (placement.reason or "").endswith(
        "It fits with --gpu-memory-utilization 0.812 (after --)."
    )


def test_a_catalogs_devices_pin_a_model_and_a_wrong_one_is_refused(qwen25_1_5b: Path) -> None:
    cards = [gpu(24, 23), GpuInfo("1", "NVIDIA test GPU", 24 * GiB, 23 * GiB)]
    pinned = EngineAsk("alpha", qwen25_1_5b, devices=(1,))
    result = plan([pinned, EngineAsk("beta", qwen25_1_5b)], cards)
    assert result.engines[0].devices == [1]
    # Beside it: the fullest GPU that still holds it, leaving GPU 0 whole for a bigger model.
    assert result.engines[1].devices == [1]
    assert result.resident_at_once == ["alpha", "beta"]
    wrong = plan([EngineAsk("alpha", qwen25_1_5b, devices=(2,))], cards).engines[0]
    assert wrong.fits is False
    assert (wrong.reason or "").startswith("devices [2] names GPU 2, but this machine has 2")


def test_max_loaded_models_and_the_budget_bound_who_is_resident(qwen25_1_5b: Path) -> None:
    asks = [EngineAsk(name, qwen25_1_5b) for name in ("alpha", "beta", "gamma")]
    assert plan(asks, [gpu(80, 79)]).resident_at_once == ["alpha", "beta", "gamma"]
    assert plan(asks, [gpu(80, 79)], max_loaded=2).resident_at_once == ["alpha", "beta"]
    kept = [asks[0], asks[1], EngineAsk("gamma", qwen25_1_5b, keep=True)]
    assert plan(kept, [gpu(80, 79)], max_loaded=1).resident_at_once == ["gamma"]


def test_a_model_without_its_files_is_not_guessed() -> None:
    ask = EngineAsk("remote", None, unknown="cannot tell: not in the Hugging Face cache")
    [placement] = plan([ask], EIGHT_SEVEN).engines
    assert placement.fits is None and placement.reason == ask.unknown


def test_a_catalog_counts_each_gpu_apart_and_rechecks_at_boot(qwen25_1_5b: Path) -> None:
    from loragate.plan.gpu.placement import boot_refusal, fits_on_gpus, gpu_room

    cards = [gpu(24, 23), GpuInfo("1", "NVIDIA test GPU", 24 * GiB, 23 * GiB)]
    result = plan([EngineAsk("alpha", qwen25_1_5b), EngineAsk("beta", qwen25_1_5b)], cards)
    alpha, beta = result.engines
    room = gpu_room(cards)
    assert fits_on_gpus(beta.held_bytes, [alpha.held_bytes], room)
    # Two GPUs' free memory is not one pool: a third such engine does not fit on GPU 0.
    assert not fits_on_gpus(beta.held_bytes, [alpha.held_bytes, beta.held_bytes], room)
    assert fits_on_gpus({1: beta.held_bytes[0]}, [alpha.held_bytes, beta.held_bytes], room)
    # A slice whose memory nvidia-smi does not give has no room listed, not a room of 0:
    # the plan cannot tell, so nothing is refused there.
    unread = GpuInfo("0:1", "NVIDIA test GPU MIG 1g.10gb", 0, 0, "MIG-x", memory_known=False)
    assert gpu_room([*cards, unread]) == room
    assert fits_on_gpus({2: 8 * GiB}, [alpha.held_bytes], gpu_room([*cards, unread]))
    assert boot_refusal(alpha, cards) is None
    taken = [GpuInfo("0", "NVIDIA test GPU", 24 * GiB, 8 * GiB)]  # another program woke up
    assert "only 8.0 GiB is free there now: vLLM would refuse to start" in (
        boot_refusal(alpha, taken) or ""
    )


def test_a_memory_budget_caps_what_the_resident_engines_hold_together(qwen25_1_5b: Path) -> None:
    asks = [EngineAsk("alpha", qwen25_1_5b), EngineAsk("beta", qwen25_1_5b)]
    result = plan(asks, [gpu(24, 23)], budget=16 * GiB)
    assert result.resident_at_once == ["alpha", "beta"]
    held = sum(sum(engine.held_bytes.values()) for engine in result.engines)
    assert held <= 16 * GiB
    for engine in result.engines:
        assert (engine.kv_cache_bytes or 0) >= (engine.one_sequence_kv_bytes or 0)


# A share of the user's own is checked against vLLM's rule alone (v1/worker/utils.py:761-770):
# share x torch's total, which leaves out what the driver keeps back, must be free after the
# engine's CUDA context. nvidia-smi's total counts that reserve; its free does not.
IDLE_4090 = GpuInfo("0", "NVIDIA GeForce RTX 4090", 24564 << 20, 24210 << 20)
IDLE_H100 = GpuInfo("0", "NVIDIA H100 80GB HBM3", 81559 << 20, 81004 << 20)


@pytest.mark.parametrize(("card", "share"), [(IDLE_4090, "0.97"), (IDLE_H100, "0.99")])
def test_a_users_high_share_on_an_idle_card_is_warned_about_not_refused(
    qwen25_1_5b: Path, card: GpuInfo, share: str
) -> None:
    from loragate.plan.gpu.placement import boot_refusal

    placement = one(qwen25_1_5b, [card], "--gpu-memory-utilization", share)
    assert placement.fits is True and placement.reason is None
    assert placement.share == float(share) and placement.args == []  # the user's, unchanged
    [warning] = placement.warnings
    assert warning.startswith(f"--gpu-memory-utilization {share} asks vLLM for")
    assert "vLLM starts only if that much is still free once its CUDA context" in warning
    assert boot_refusal(placement, [card]) is None
    # What vLLM surely refuses (more than is free even with the largest reserve) still is.
    taken = GpuInfo("0", card.name, card.total_bytes, card.free_bytes // 2)
    assert "vLLM would refuse to start" in (boot_refusal(placement, [taken]) or "")


def test_the_tokenizers_length_does_not_cap_a_generative_models_context(
    tmp_path: Path,
) -> None:
    # DeepSeek-R1-Distill-Qwen-7B: config.json 131072, tokenizer_config.json 16384. vLLM reads
    # the tokenizer's config only for pooling models (config/model.py:2131-2141).
    import json

    from loragate.plan.preflight.model_files import derived_max_len

    model = model_dir(tmp_path / "r1-distill", QWEN25_7B)
    config = json.loads((model / "config.json").read_text()) | {"max_position_embeddings": 131072}
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 16384}))
    placement = one(model, [gpu(80, 79)])
    assert placement.max_model_len == 131072
    assert placement.one_sequence_kv_bytes == 131072 * QWEN25_7B.kv_bytes_per_token
    # A pooling model with absolute position embeddings is the one vLLM caps.
    bert = {"architectures": ["BertModel"], "position_embedding_type": "absolute",
            "max_position_embeddings": 512}  # fmt: skip
    assert derived_max_len(bert, {"model_max_length": 256}, pooling=True) == 256
    assert derived_max_len(bert, {"model_max_length": 256}) == 512


def _quantized(tmp_path: Path, name: str, settings: dict[str, object]) -> Path:
    import json

    model = model_dir(tmp_path / name, QWEN25_1_5B)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": settings}))
    return model


@pytest.mark.parametrize(
    "settings",
    [
        # vLLM's INC method takes AutoRound checkpoints (quantization/inc/inc.py:361-368)...
        {"quant_method": "auto-round", "bits": 4, "group_size": 128,
         "packing_format": "auto_round:auto_gptq"},
        # ...and spells compressed_tensors its own way (model_arch_config_convertor.py:299).
        {"quant_method": "compressed_tensors", "config_groups": {
            "group_0": {"weights": {"num_bits": 8, "type": "float"}}}},
    ],
)  # fmt: skip
def test_quantization_names_vllm_rewrites_are_not_refused(
    tmp_path: Path, settings: dict[str, object]
) -> None:
    placement = one(_quantized(tmp_path, "quantized", settings), [gpu(24, 23)])
    assert placement.fits is True, placement.reason


def test_a_checkpoint_method_vllm_cannot_take_is_refused_and_one_it_may_take_is_not(
    tmp_path: Path,
) -> None:
    bnb = _quantized(tmp_path, "bnb", {"quant_method": "bitsandbytes", "bits": 4})
    refused = one(bnb, [gpu(24, 23)])
    assert refused.fits is False
    assert (refused.reason or "").startswith(
        "the checkpoint is quantized with bitsandbytes, which vLLM 0.32.0 does not take"
    )
    # A name vLLM's override_quantization_method functions test for (here one a user's
    # --quantization may spell): what vLLM makes of it in a checkpoint is not guessed.
    marlin = _quantized(tmp_path, "marlin", {"quant_method": "marlin", "bits": 4})
    unsure = one(marlin, [gpu(24, 23)])
    assert unsure.fits is None
    assert (unsure.reason or "").startswith("cannot tell: the checkpoint is quantized with marlin")
