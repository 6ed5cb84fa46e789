"""Sliding-window and hybrid models in the GPU plan: a sliding-window layer keeps its window
and the tokens in flight, not the whole sequence, and Mamba and linear-attention layers keep no
KV cache at all (vLLM's hybrid KV cache manager, on for GPUs with LoRA or without). The configs
are the hub's (Gemma 3, Granite 4.0-H, Jamba, Qwen3-Next) over weights' headers alone; the one
sequence vLLM needs is checked against vLLM's own function where vLLM imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loragate.plan.gpu.need import EngineAsk
from loragate.plan.gpu.placement import Placement, plan_gpus
from loragate.plan.gpu.serve_plan import write_header
from loragate.plan.gpu.vllm_rules import engine_rules, one_sequence_kv_bytes
from loragate.plan.preflight.kv_layers import KvLayers, kv_layers
from loragate.plan.preflight.machine import GpuInfo

GiB = 1 << 30
RTX_4090 = GpuInfo("0", "NVIDIA GeForce RTX 4090", 24564 << 20, 24210 << 20)
L40S = GpuInfo("0", "NVIDIA L40S", 48 * GiB, 47 * GiB)

# google/gemma-3-4b-it's text_config as the hub has it: heads, head_dim and length are
# transformers' Gemma3TextConfig defaults (8, 4 KV heads of 256, 131072).
GEMMA3_4B_HUB = {
    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}  # fmt: skip
GEMMA3_4B = GEMMA3_4B_HUB | {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072, "sliding_window_pattern": 6, "vocab_size": 262208,
}  # fmt: skip
GEMMA3_12B = GEMMA3_4B | {
    "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8,
}  # fmt: skip
# ibm-granite/granite-4.0-h-tiny's shape: 4 attention layers among 40, the rest Mamba 2.
GRANITE_4_H = {
    "model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
    "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 40,
    "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "vocab_size": 100352, "mamba_d_state": 128, "mamba_n_heads": 48, "torch_dtype": "bfloat16",
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
}  # fmt: skip


def gemma(text: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": text, "torch_dtype": "bfloat16"}  # fmt: skip


def model(directory: Path, config: dict[str, Any], parameters: float) -> Path:
    """``config`` over one safetensors header of ``parameters`` bfloat16 weights (no data)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    count = int(parameters)
    tensors = {"model.weight": {"dtype": "BF16", "shape": [count], "data_offsets": [0, 2 * count]}}
    write_header(directory / "model.safetensors", tensors)
    return directory


def plan_one(path: Path, card: GpuInfo, *args: str) -> Placement:
    return plan_gpus([EngineAsk(path.name, path, args)], [card], engine_rules()).engines[0]


def test_gemma_3_4b_with_defaults_fits_a_24_gib_gpu_by_its_sliding_windows(
    tmp_path: Path,
) -> None:
    placement = plan_one(model(tmp_path / "gemma-3-4b", gemma(GEMMA3_4B), 4.3e9), RTX_4090)
    assert placement.fits is True, placement.reason
    assert placement.max_model_len == 131072
    # 5 global layers hold the whole sequence, 29 sliding ones 1023 tokens plus two batches of
    # 2048 in flight: 3.1 GiB, vLLM's own figure (test_the_rule_is_vllms below), not the 17 GiB
    # of every layer holding 131072 tokens.
    assert placement.one_sequence_kv_bytes == 3315466240
    # The hub's config, which leaves heads and length to transformers, plans the same.
    hub = plan_one(model(tmp_path / "gemma-3-4b-hub", gemma(GEMMA3_4B_HUB), 4.3e9), RTX_4090)
    assert (hub.fits, hub.max_model_len, hub.one_sequence_kv_bytes, hub.share) == (
        True, 131072, 3315466240, placement.share
    )  # fmt: skip


def test_gemma_3_12b_with_defaults_fits_a_48_gib_gpu(tmp_path: Path) -> None:
    placement = plan_one(model(tmp_path / "gemma-3-12b", gemma(GEMMA3_12B), 12.2e9), L40S)
    assert placement.fits is True, placement.reason
    assert placement.one_sequence_kv_bytes == 10272899072  # not 48 GiB


def test_with_the_hybrid_manager_off_every_attention_layer_holds_the_whole_sequence(
    tmp_path: Path,
) -> None:
    path = model(tmp_path / "gemma-3-4b", gemma(GEMMA3_4B), 4.3e9)
    placement = plan_one(path, RTX_4090, "--disable-hybrid-kv-cache-manager")
    assert placement.fits is False
    assert placement.one_sequence_kv_bytes == 34 * 2 * 4 * 256 * 2 * 131072  # 17 GiB
    # --disable-sliding-window caps the length at the window (config/model.py:2542-2550).
    capped = plan_one(path, RTX_4090, "--disable-sliding-window")
    assert capped.fits is True and capped.max_model_len == 1024


def test_a_hybrid_models_mamba_layers_hold_no_kv_cache(tmp_path: Path) -> None:
    placement = plan_one(model(tmp_path / "granite-4.0-h", GRANITE_4_H, 7e9), RTX_4090)
    assert placement.fits is True, placement.reason
    # Its 4 attention layers: 4 x 2 x 4 KV heads x 128 x 2 bytes x 131072 tokens = 1 GiB.
    assert placement.one_sequence_kv_bytes == GiB


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Jamba: attention every attn_layer_period-th layer from attn_layer_offset.
        ({"model_type": "jamba", "num_hidden_layers": 32, "attn_layer_period": 8,
          "attn_layer_offset": 4, "mamba_d_state": 16}, KvLayers(4, state=28)),
        # Qwen3-Next: full attention every full_attention_interval-th layer, else linear.
        ({"model_type": "qwen3_next", "num_hidden_layers": 48, "full_attention_interval": 4,
          "linear_conv_kernel_dim": 4}, KvLayers(12, state=36)),
        ({"model_type": "nemotron_h", "num_hidden_layers": 6,
          "hybrid_override_pattern": "M-M*-E"}, KvLayers(1, state=2)),
        ({"model_type": "gpt_oss", "num_hidden_layers": 24, "sliding_window": 128},
         KvLayers(12, 12, 128)),
        ({"model_type": "mistral", "num_hidden_layers": 32, "sliding_window": 4096},
         KvLayers(0, 32, 4096)),
        ({"model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 131072,
          "use_sliding_window": False}, KvLayers(28)),
        ({"model_type": "llama", "num_hidden_layers": 32}, KvLayers(32)),
    ],
)  # fmt: skip
def test_which_layers_keep_what_is_read_as_transformers_and_vllm_read_it(
    config: dict[str, Any], expected: KvLayers
) -> None:
    assert kv_layers(config) == expected


def test_a_config_that_does_not_say_which_layers_slide_is_not_guessed(tmp_path: Path) -> None:
    config = {"model_type": "exaone4", "architectures": ["Exaone4ForCausalLM"],
              "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 131072, "sliding_window": 4096, "vocab_size": 102400,
              "torch_dtype": "bfloat16"}  # fmt: skip
    assert str(kv_layers(config)).startswith("cannot tell")
    placement = plan_one(model(tmp_path / "exaone", config, 8e9), RTX_4090)
    assert placement.fits is None
    assert (placement.reason or "").startswith("cannot tell whether exaone fits")
    assert "a KV cache it cannot size (config.json has a sliding_window" in (placement.reason or "")


_VLLM_RULE = textwrap.dedent("""\
    import json, sys
    from types import SimpleNamespace as NS
    import torch
    from vllm.v1.core import kv_cache_utils as K
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    answers = []
    for kinds, heads, head_dim, window, tokens, in_flight in json.loads(sys.argv[1]):
        config = NS(
            model_config=NS(max_model_len=tokens),
            parallel_config=NS(decode_context_parallel_size=1),
            scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
            cache_config=NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBNHC,
                            num_gpu_blocks_override=None),
            attention_config=NS(hisparse_config=None),
            max_in_flight_tokens=in_flight, num_prefill_lookahead_tokens=0,
            speculative_config=None,
        )
        common = dict(block_size=16, num_kv_heads=heads, head_size=head_dim,
                      dtype=torch.bfloat16)
        specs = {
            f"layer.{i}": FullAttentionSpec(**common) if kind == "f"
            else SlidingWindowSpec(**common, sliding_window=window)
            for i, kind in enumerate(kinds)
        }
        groups = K.get_kv_cache_groups(config, specs)
        answers.append([K._max_memory_usage_bytes_from_groups(config, groups),
                        K._pool_bytes_per_block(config, groups)])
    print(json.dumps(answers))
""")


def test_the_rule_is_vllms() -> None:
    """The plan's one-sequence rule against vLLM's own (``_max_memory_usage_bytes_from_groups``
    over the groups ``get_kv_cache_groups`` makes), where the installed vLLM imports."""
    from loragate.plan.gpu.vllm_rules import pool_block_bytes

    cases = [  # (layers, KV heads, head dim, window, max_model_len, tokens in flight)
        (KvLayers(5, 29, 1024), 4, 256, 131072, 4096),  # Gemma 3 4B
        (KvLayers(8, 40, 1024), 8, 256, 131072, 4096),  # Gemma 3 12B
        (KvLayers(12, 12, 128), 8, 64, 131072, 16384),  # gpt-oss-20b on an H100
        (KvLayers(0, 32, 4096), 8, 128, 32768, 4096),  # Mistral 7B v0.1
        (KvLayers(5, 29, 1024), 4, 256, 2000, 4096),  # shorter than window and batches
        (KvLayers(36), 8, 128, 40960, 4096),  # Qwen3-4B
    ]
    gemma_kinds = ["f" if (i + 1) % 6 == 0 else "s" for i in range(48)]
    kinds = {
        KvLayers(5, 29, 1024): gemma_kinds[:34],
        KvLayers(8, 40, 1024): gemma_kinds,
        KvLayers(12, 12, 128): ["s" if i % 2 == 0 else "f" for i in range(24)],
        KvLayers(0, 32, 4096): ["s"] * 32,
        KvLayers(36): ["f"] * 36,
    }
    asked = [[kinds[layers], heads, dim, layers.window, tokens, flight]
             for layers, heads, dim, tokens, flight in cases]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _VLLM_RULE, json.dumps(asked)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    if done.returncode != 0:
        pytest.skip(f"vLLM's KV cache grouping does not run here: {done.stderr[-300:]}")
    answers = json.loads(done.stdout.splitlines()[-1])
    planned = [
        [one_sequence_kv_bytes(layers, 2 * heads * dim * 2, tokens, flight),
         pool_block_bytes(layers, 2 * heads * dim * 2)]
        for layers, heads, dim, tokens, flight in cases
    ]  # fmt: skip
    assert planned == answers
