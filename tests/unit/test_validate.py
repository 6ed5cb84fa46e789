from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.intake.validate import AdapterRejected, validate_adapter
from loragate.base_model.resolve import read_base_config
from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from tests.adapter_fixtures import llama_lora_shapes, peft_config, write_shaped_adapter

# The demo base model's geometry: hidden 128, 4 heads of 32, 2 KV heads, MLP 256.
LLAMA: dict[str, Any] = {
    "_name_or_path": "tiny-llama",
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 384,
    "tie_word_embeddings": False,
}
IDEFICS3: dict[str, Any] = {
    "model_type": "idefics3",
    "text_config": {k: v for k, v in LLAMA.items() if k != "_name_or_path"},
    "vision_config": {"hidden_size": 64},
}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(
    tmp_path: Path, shapes: Mapping[str, tuple[int, ...]] | None = None, **config: Any
) -> Path:
    return write_shaped_adapter(
        tmp_path / "adapter",
        shapes or llama_lora_shapes(LLAMA),
        peft_config(**{"modules": ALL_MODULES, **config}),
    )


def _rejected(adapter: Path, base: dict[str, Any] = LLAMA, max_rank: int = 16) -> str:
    with pytest.raises(AdapterRejected) as caught:
        validate_adapter(adapter, base, max_rank)
    return str(caught.value)


def test_demo_adapters_pass_and_report_their_facts(demo_dir: Path) -> None:
    base = read_base_config(demo_base_dir(demo_dir))
    for name in ("pong", "fox", "owl"):
        adapter = demo_adapter_dir(demo_dir, name)
        facts = validate_adapter(adapter, base, max_lora_rank=16)
        assert facts.rank == 8
        assert facts.alpha == 16
        assert facts.target_modules == tuple(sorted(ALL_MODULES))
        assert facts.num_tensors == 2 * 7 * 2
        expected = sum(
            (adapter / f).stat().st_size
            for f in ("adapter_model.safetensors", "adapter_config.json")
        )
        assert facts.size_bytes == expected


def test_well_shaped_adapter_passes(tmp_path: Path) -> None:
    facts = validate_adapter(_adapter(tmp_path), LLAMA, 8)
    assert (facts.rank, facts.num_tensors) == (8, 28)


def test_missing_config_is_refused_with_convert_hint(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    (adapter / "adapter_config.json").unlink()
    assert "gateway adapters convert" in _rejected(adapter)


def test_unparseable_config_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    (adapter / "adapter_config.json").write_text("{r: 8")
    assert "not valid JSON" in _rejected(adapter)


def test_non_lora_peft_type_is_refused(tmp_path: Path) -> None:
    assert "only LORA" in _rejected(_adapter(tmp_path, peft_type="IA3"))


def test_dora_adapter_is_refused_with_reason(tmp_path: Path) -> None:
    assert "DoRA" in _rejected(_adapter(tmp_path, use_dora=True))


def test_modules_to_save_is_refused(tmp_path: Path) -> None:
    message = _rejected(_adapter(tmp_path, modules_to_save=["lm_head"]))
    assert "modules_to_save" in message and "lm_head" in message


def test_trained_bias_is_refused(tmp_path: Path) -> None:
    assert "bias='none'" in _rejected(_adapter(tmp_path, bias="lora_only"))


def test_config_without_lora_alpha_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert "no lora_alpha" in _rejected(adapter)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), float("-inf"), 0, -16])
def test_a_non_finite_or_non_positive_lora_alpha_is_refused(tmp_path: Path, alpha: float) -> None:
    # adapter_config.json as json.dumps writes it: NaN and Infinity, which json.loads reads back.
    message = _rejected(_adapter(tmp_path, alpha=alpha))
    assert f"lora_alpha must be a finite number above 0, got {alpha!r}" in message


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("rank_pattern", float("inf"), "rank_pattern['q_proj'] must be a positive whole number"),
        ("rank_pattern", float("nan"), "rank_pattern['q_proj'] must be a positive whole number"),
        ("rank_pattern", 0, "rank_pattern['q_proj'] must be a positive whole number"),
        ("rank_pattern", 2.5, "rank_pattern['q_proj'] must be a positive whole number"),
        ("alpha_pattern", float("nan"), "alpha_pattern['q_proj'] must be a finite number above 0"),
        ("alpha_pattern", "16", "alpha_pattern['q_proj'] must be a finite number above 0"),
    ],
)
def test_a_bad_number_in_a_rank_or_alpha_pattern_is_refused_naming_it(
    tmp_path: Path, field: str, value: Any, reason: str
) -> None:
    assert reason in _rejected(_adapter(tmp_path, **{field: {"q_proj": value}}))


def test_whole_number_patterns_pass(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, rank_pattern={"q_proj": 8.0}, alpha_pattern={"q_proj": 4})
    assert validate_adapter(adapter, LLAMA, 16).rank == 8


def test_bin_only_adapter_is_refused_with_convert_hint(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    shutil.move(adapter / "adapter_model.safetensors", adapter / "adapter_model.bin")
    message = _rejected(adapter)
    assert "adapter_model.bin" in message and "gateway adapters convert" in message


def test_truncated_weights_are_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "truncated" in _rejected(adapter)


def test_keys_with_the_peft_adapter_name_are_refused(tmp_path: Path) -> None:
    shapes = {
        k.replace(".lora_A.weight", ".lora_A.default.weight"): s
        for k, s in llama_lora_shapes(LLAMA).items()
    }
    message = _rejected(_adapter(tmp_path, shapes))
    assert "'default'" in message and "convert" in message


def test_unsupported_module_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    shapes = {
        "base_model.model.model.layers.0.self_attn.rotary_emb.lora_A.weight": (8, 128),
        "base_model.model.model.layers.0.self_attn.rotary_emb.lora_B.weight": (128, 8),
    }
    message = _rejected(_adapter(tmp_path, shapes))
    assert "rotary_emb" in message and "q_proj" in message


def test_dora_magnitude_tensor_is_refused(tmp_path: Path) -> None:
    shapes = dict(llama_lora_shapes(LLAMA))
    shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = (128,)
    assert "not a LoRA weight" in _rejected(_adapter(tmp_path, shapes))


def test_lora_for_a_wider_model_is_refused_with_both_sizes(tmp_path: Path) -> None:
    wider = {**LLAMA, "hidden_size": 256, "head_dim": 64}
    message = _rejected(_adapter(tmp_path, llama_lora_shapes(wider, modules=("q_proj",))))
    assert (
        "q_proj expects in_features 128 (base model hidden_size) but the adapter has 256" in message
    )


def test_lora_with_other_kv_heads_is_refused_with_both_sizes(tmp_path: Path) -> None:
    other = {**LLAMA, "num_key_value_heads": 4}
    message = _rejected(_adapter(tmp_path, llama_lora_shapes(other, modules=("k_proj",))))
    assert "k_proj expects out_features 64" in message and "has 128" in message
    assert "num_key_value_heads 2" in message


def test_lora_with_other_mlp_width_is_refused(tmp_path: Path) -> None:
    other = {**LLAMA, "intermediate_size": 512}
    message = _rejected(_adapter(tmp_path, llama_lora_shapes(other, modules=("down_proj",))))
    assert (
        "down_proj expects in_features 256 (base model intermediate_size) but the adapter has 512"
        in message
    )


def test_layer_beyond_the_base_model_is_refused(tmp_path: Path) -> None:
    deeper = {**LLAMA, "num_hidden_layers": 4}
    message = _rejected(_adapter(tmp_path, llama_lora_shapes(deeper)))
    assert "layer 2" in message and "2 layers" in message


def test_rank_above_max_lora_rank_names_the_flag_and_valid_values(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, llama_lora_shapes(LLAMA, rank=32), r=32)
    message = _rejected(adapter, max_rank=16)
    assert "--max-lora-rank 32" in message
    assert "1, 8, 16, 32, 64, 128, 256, 320, 512" in message


def test_rank_pattern_above_max_lora_rank_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, rank_pattern={"q_proj": 64})
    assert "adapter rank 64" in _rejected(adapter, max_rank=16)


def test_rank_above_512_cannot_be_served_at_all(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path, llama_lora_shapes(LLAMA, rank=600, modules=("q_proj",)), r=600)
    assert "cannot be served" in _rejected(adapter, max_rank=512)


def test_mismatched_a_and_b_ranks_are_refused(tmp_path: Path) -> None:
    shapes = llama_lora_shapes(LLAMA, modules=("q_proj",))
    shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = (128, 4)
    assert "lora_A has rank 8 but lora_B has rank 4" in _rejected(_adapter(tmp_path, shapes))


def test_missing_lora_b_is_refused(tmp_path: Path) -> None:
    shapes = llama_lora_shapes(LLAMA, modules=("q_proj",))
    del shapes["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert "no lora_B" in _rejected(_adapter(tmp_path, shapes))


def test_quantized_weights_are_refused(tmp_path: Path) -> None:
    adapter = write_shaped_adapter(
        tmp_path / "a", llama_lora_shapes(LLAMA), peft_config(), dtype="I8"
    )
    assert "dtype I8" in _rejected(adapter)


def test_three_dimensional_expert_tensors_are_refused_with_convert_hint(tmp_path: Path) -> None:
    shapes = {
        "base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight": (1, 8, 128),
        "base_model.model.model.layers.0.mlp.experts.w1.lora_B.weight": (4, 256, 8),
    }
    message = _rejected(_adapter(tmp_path, shapes))
    assert "Tinker" in message and "gateway adapters convert" in message


def test_lm_head_and_embedding_loras_with_right_shapes_pass(tmp_path: Path) -> None:
    shapes = {
        "base_model.model.lm_head.lora_A.weight": (8, 128),
        "base_model.model.lm_head.lora_B.weight": (384, 8),
        "base_model.model.model.embed_tokens.lora_embedding_A": (8, 384),
        "base_model.model.model.embed_tokens.lora_embedding_B": (128, 8),
    }
    facts = validate_adapter(_adapter(tmp_path, shapes), LLAMA, 8)
    assert facts.target_modules == ("embed_tokens", "lm_head")


def test_lm_head_lora_for_another_vocabulary_is_refused(tmp_path: Path) -> None:
    shapes = {
        "base_model.model.lm_head.lora_A.weight": (8, 128),
        "base_model.model.lm_head.lora_B.weight": (32000, 8),
    }
    message = _rejected(_adapter(tmp_path, shapes))
    assert (
        "lm_head expects out_features 384 (base model vocab_size) but the adapter has 32000"
        in message
    )


def test_vision_language_base_accepts_its_text_model_paths(tmp_path: Path) -> None:
    shapes = llama_lora_shapes(IDEFICS3, prefix="model.text_model")
    facts = validate_adapter(_adapter(tmp_path, shapes), IDEFICS3, 16)
    assert facts.rank == 8


def test_text_only_lora_on_a_vision_language_base_is_refused(tmp_path: Path) -> None:
    message = _rejected(_adapter(tmp_path), base=IDEFICS3)
    assert "text-only model" in message and "model.text_model" in message


def test_vision_language_lora_on_a_text_only_base_is_refused(tmp_path: Path) -> None:
    shapes = llama_lora_shapes(IDEFICS3, prefix="model.text_model")
    assert "vision-language model" in _rejected(_adapter(tmp_path, shapes))


def test_moe_expert_loras_are_checked_against_the_expert_width(tmp_path: Path) -> None:
    moe = {**LLAMA, "num_experts": 2, "moe_intermediate_size": 64}
    stem = "base_model.model.model.layers.0.mlp.experts"
    good = {
        f"{stem}.1.gate_proj.lora_A.weight": (8, 128),
        f"{stem}.1.gate_proj.lora_B.weight": (64, 8),
    }
    assert validate_adapter(_adapter(tmp_path, good), moe, 8).target_modules == ("gate_proj",)
    bad = {
        f"{stem}.2.gate_proj.lora_A.weight": (8, 128),
        f"{stem}.2.gate_proj.lora_B.weight": (64, 8),
    }
    assert "expert 2" in _rejected(_adapter(tmp_path / "bad", bad), base=moe)
