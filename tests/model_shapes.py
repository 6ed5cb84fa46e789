"""Model directories shaped like real ones, for nothing: a ``config.json`` as the hub has it and
one safetensors file whose header lists every tensor of the real checkpoint (names, dtypes,
shapes, offsets) over a sparse hole as big as the weights. The plan reads only these, so a
7B model costs a few hundred KiB of header and no disk.

The shapes are those of Qwen/Qwen3-4B, Qwen/Qwen2.5-1.5B-Instruct and Qwen/Qwen2.5-7B-Instruct
(their config.json on the hub).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class Shape:
    """What a Qwen-family decoder's checkpoint holds."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tied: bool
    qkv_bias: bool  # Qwen2.5's q/k/v projections have biases
    qk_norm: bool  # Qwen3 normalises queries and keys per head

    def config(self) -> dict[str, Any]:
        architecture = "Qwen3ForCausalLM" if self.model_type == "qwen3" else "Qwen2ForCausalLM"
        return {
            "architectures": [architecture],
            "model_type": self.model_type,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
        }

    def tensors(self, dtype: str = "BF16") -> dict[str, list[int]]:
        """Every tensor of the checkpoint and its shape, in the checkpoint's names."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        found: dict[str, list[int]] = {"model.embed_tokens.weight": [self.vocab, self.hidden]}
        for n in range(self.layers):
            layer = f"model.layers.{n}"
            found |= {
                f"{layer}.input_layernorm.weight": [self.hidden],
                f"{layer}.post_attention_layernorm.weight": [self.hidden],
                f"{layer}.self_attn.q_proj.weight": [q, self.hidden],
                f"{layer}.self_attn.k_proj.weight": [kv, self.hidden],
                f"{layer}.self_attn.v_proj.weight": [kv, self.hidden],
                f"{layer}.self_attn.o_proj.weight": [self.hidden, q],
                f"{layer}.mlp.gate_proj.weight": [self.intermediate, self.hidden],
                f"{layer}.mlp.up_proj.weight": [self.intermediate, self.hidden],
                f"{layer}.mlp.down_proj.weight": [self.hidden, self.intermediate],
            }
            if self.qkv_bias:
                found |= {
                    f"{layer}.self_attn.q_proj.bias": [q],
                    f"{layer}.self_attn.k_proj.bias": [kv],
                    f"{layer}.self_attn.v_proj.bias": [kv],
                }
            if self.qk_norm:
                found |= {
                    f"{layer}.self_attn.q_norm.weight": [self.head_dim],
                    f"{layer}.self_attn.k_norm.weight": [self.head_dim],
                }
        found["model.norm.weight"] = [self.hidden]
        if not self.tied:
            found["lm_head.weight"] = [self.vocab, self.hidden]
        return found

    def parameters(self) -> int:
        total = 0
        for shape in self.tensors().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of every layer, in bfloat16."""
        return self.layers * 2 * self.kv_heads * self.head_dim * 2


QWEN3_4B = Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, 40960, True, False, True)
QWEN25_1_5B = Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, 32768, True, True, False)
QWEN25_7B = Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, 32768, False, True, False)


def model_dir(directory: Path, shape: Shape, dtype: str = "BF16") -> Path:
    """``directory`` holding ``shape``'s config.json and its weights' header over a hole."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.config(), indent=2))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shape.tensors(dtype).items():
        nbytes = _BYTES[dtype]
        for dim in dims:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with (directory / "model.safetensors").open("wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        file.truncate(8 + len(raw) + offset)  # sparse: no block of it is written
    return directory
