"""The CPU build's KV cache, sized by loragate when the user did not size it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loragate.plan.cpu import (
    GIB,
    ModelDoesNotFit,
    plan_kv_cache,
    user_sized,
)

# SmolLM2-135M-Instruct's shape: 30 layers, 3 KV heads of 64, 8192 positions.
SMOLLM2 = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


def model_dir(tmp_path: Path, config: dict[str, object], weights: int = 0) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with (tmp_path / "model.safetensors").open("wb") as handle:
        handle.truncate(weights)
    return tmp_path


def test_explicit_engine_flags_or_env_always_win() -> None:
    assert user_sized(["--gpu-memory-utilization", "0.5"], {})
    assert user_sized(["--kv-cache-memory-bytes=2000000000"], {})
    assert user_sized([], {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert not user_sized(["--max-model-len", "512"], {"VLLM_CPU_KVCACHE_SPACE": ""})


def test_plan_fits_a_few_full_sequences_within_half_of_what_is_free(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, SMOLLM2, weights=540 * 1024 * 1024)
    plan = plan_kv_cache(directory, SMOLLM2, [], available_bytes=8 * GIB)
    per_token = 2 * 30 * 3 * 64 * 4
    assert plan.bytes_per_token == per_token and plan.max_model_len == 8192
    assert plan.kv_bytes == 4 * per_token * 8192  # four full sequences, well within budget
    assert plan.engine_args() == ["--kv-cache-memory-bytes", str(plan.kv_bytes)]
    assert "GiB" in plan.describe() and "VLLM_CPU_KVCACHE_SPACE" in plan.describe()


def test_max_model_len_and_dtype_flags_change_the_plan(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, SMOLLM2)
    plan = plan_kv_cache(
        directory, SMOLLM2, ["--max-model-len", "2048", "--dtype=bfloat16"], available_bytes=8 * GIB
    )
    assert plan.max_model_len == 2048 and plan.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert plan.kv_bytes == GIB  # four sequences are less than the 1 GiB floor


def test_a_tight_machine_gets_what_fits(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, SMOLLM2)
    plan = plan_kv_cache(directory, SMOLLM2, [], available_bytes=3 * GIB)
    assert plan.kv_bytes == int((3 * GIB - 3 * GIB // 2) * 0.5)
    assert plan.kv_bytes >= plan.bytes_per_token * plan.max_model_len


def test_a_model_that_cannot_fit_is_refused_with_what_would_make_it_fit(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, SMOLLM2, weights=GIB)
    with pytest.raises(ModelDoesNotFit, match=r"--max-model-len \d+") as caught:
        plan_kv_cache(directory, SMOLLM2, [], available_bytes=int(2.9 * GIB))
    assert "does not fit" in str(caught.value)


def test_vision_models_are_sized_by_their_text_config(tmp_path: Path) -> None:
    config = {"text_config": {**SMOLLM2, "max_position_embeddings": 512}}
    plan = plan_kv_cache(model_dir(tmp_path, config), config, [], available_bytes=8 * GIB)
    assert plan.max_model_len == 512 and plan.kv_bytes == GIB
