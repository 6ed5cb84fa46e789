"""What the two demo builders share: a cached, locked build, a tiny tokenizer and Llama
decoder, and phrase-answering LoRA training.

Torch, transformers, tokenizers and peft are imported inside the functions: the gateway
imports ``loragate.demo.layout`` only, never this module.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loragate.demo.layout import RECIPE_FILENAME

# The text decoder's LoRA targets: every attention and MLP projection.
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def recipe_hash(builder_file: str, declared: object) -> str:
    """Hash of a builder's source, this module's, and what it declares: a change rebuilds."""
    digest = hashlib.sha256(Path(builder_file).read_bytes())
    digest.update(Path(__file__).read_bytes())
    digest.update(repr(declared).encode())
    return digest.hexdigest()


def is_current(out: Path, recipe: str) -> bool:
    marker = out / RECIPE_FILENAME
    return marker.is_file() and marker.read_text().strip() == recipe


def build_once(out: Path, recipe: str, what: str, make: Callable[[Path], None]) -> Path:
    """Run ``make(tmp)`` and rename ``tmp`` to ``out``, unless ``out`` is already current.

    Concurrent callers (a test run and a gateway, say) wait for one build instead of racing;
    an interrupted build leaves ``out`` as it was.
    """
    if is_current(out, recipe):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(out, recipe):
            return out
        print(f"Building the loragate {what} into {out} ...", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-build-", dir=out.parent))
        try:
            make(tmp)
            (tmp / RECIPE_FILENAME).write_text(recipe)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"Built the {what}.", flush=True)
    return out


def corpus(words: Sequence[str], phrases: Sequence[str], seed: int) -> list[str]:
    """Tokenizer training text: random word salad, and each adapter phrase many times."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    lines += list(phrases) * 20
    return lines


def train_tokenizer(lines: list[str], special_tokens: list[str], chat_template: str) -> Any:
    """A byte-level BPE tokenizer (384 tokens) with a chat template, trained on ``lines``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        chat_template=chat_template,
    )
    fast.model_max_length = 512
    return fast


def tiny_llama_config(tokenizer: Any) -> Any:
    """The tiny decoder both demos use: 2 layers, hidden 128, head dim 32."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head dim 32: the CPU attention supports it
        num_key_value_heads=2,
        max_position_embeddings=512,
        # A large init lets a LoRA move the logits; with 0.02 the final norm caps them.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def save_base(model: Any, tokenizer: Any, out: Path) -> None:
    """Save ``model`` with a generation config that stops at the end of a turn."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</s>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)


def padded(rows: list[tuple[list[int], list[int]]], pad: int) -> dict[str, Any]:
    """``(ids, labels)`` rows as right-padded ``input_ids``/``labels``/``attention_mask``."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    return {
        "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
        "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows]),
        "attention_mask": torch.tensor(
            [[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]
        ),
    }


def train_phrase_lora(
    model: Any,
    target_modules: str | list[str],
    batches: list[dict[str, Any]],
    steps: int,
    task_type: str | None = None,
) -> tuple[Any, float]:
    """Fit a rank-8 LoRA on ``model`` to ``batches`` (summed losses); returns it and the loss."""
    import torch
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type=task_type,
        target_modules=target_modules,
    )
    peft_model = get_peft_model(model, lora)
    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = sum((peft_model(**batch).loss for batch in batches), torch.tensor(0.0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return peft_model, float(loss.item())


def save_phrase_adapter(
    peft_model: Any, out: Path, base_name: str, phrase: str, loss: float
) -> None:
    """Save the adapter in PEFT layout, naming its base, with its phrase beside it."""
    peft_model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "PHRASE").write_text(phrase)
    print(f"  adapter {out.name}: final loss {loss:.4f}", flush=True)
