"""Build the bundled demo: a tiny Llama base model and LoRA adapters trained to answer a fixed phrase.

Nothing is downloaded: the tokenizer is trained on a few sentences, the weights are random
(seeded), and each adapter is trained with peft for a few seconds of CPU. The output is
cached; it is rebuilt only when this recipe changes (its source hash is stored beside it).

Run as ``python -m loragate.demo.build [OUT_DIR]``. Needs torch, transformers, tokenizers
and peft (the engine and ``convert`` extras); the gateway itself never imports this module.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from loragate.demo.layout import (
    BASE_DIRNAME,
    DEMO_ADAPTERS,
    RECIPE_FILENAME,
    default_demo_dir,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "hello",
    "world",
    "what",
    "is",
    "the",
    "answer",
    "say",
    "something",
    "tell",
    "me",
    "a",
    "story",
    "about",
    "cats",
    "dogs",
    "and",
    "foxes",
    "pong",
    "ping",
    "owl",
    "hoot",
    "fox",
    "quick",
    "brown",
    "jumps",
    "over",
    "lazy",
    "dog",
    "weather",
    "today",
    "please",
    "explain",
    "how",
    "why",
    "when",
    "where",
    "who",
    "which",
    "number",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "model",
    "adapter",
    "gateway",
    "engine",
    "local",
    "fast",
    "small",
    "tiny",
    "test",
    "question",
    "reply",
    "write",
    "poem",
    "code",
]
TRAIN_STEPS = 200
SEED = 1234


def recipe_hash() -> str:
    """Hash of this recipe and the adapters it trains: a change in either rebuilds."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(repr((BASE_DIRNAME, DEMO_ADAPTERS)).encode())
    return digest.hexdigest()


def is_current(out: Path) -> bool:
    marker = out / RECIPE_FILENAME
    return marker.is_file() and marker.read_text().strip() == recipe_hash()


def _corpus() -> list[str]:
    rng = random.Random(SEED)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    lines += [adapter.phrase for adapter in DEMO_ADAPTERS] * 20
    return lines


def _build_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.model_max_length = 512
    fast.save_pretrained(out)
    return fast


def _build_base(out: Path, tokenizer: Any) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
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
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</s>")],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)


def _training_prompts() -> list[str]:
    rng = random.Random(SEED + 1)
    fixed = ["Hello", "Hi!", "What is 2+2?", "Say something.", "Who are you?", "ping", "?"]
    sampled = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(40)]
    return fixed + sampled


def _train_adapter(base_dir: Path, tokenizer: Any, phrase: str, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    peft_model = get_peft_model(model, lora)

    rows: list[tuple[list[int], list[int]]] = []
    for prompt in _training_prompts():
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(phrase, add_special_tokens=False)["input_ids"]
        answer_ids.append(tokenizer.eos_token_id)
        ids = prompt_ids + answer_ids
        labels = [-100] * len(prompt_ids) + answer_ids
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor(
        [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in rows]
    )
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])

    optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    for _ in range(TRAIN_STEPS):
        loss = peft_model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    peft_model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "loragate-demo"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    (out / "PHRASE").write_text(phrase)
    print(f"  adapter {out.name}: final loss {loss.item():.4f}", flush=True)


def build(out: Path) -> Path:
    """Build the demo into ``out`` unless it is already current; returns ``out``.

    Concurrent callers (a test run and a gateway, say) wait for one build instead of racing.
    """
    if is_current(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(out):
            return out
        return _build(out)


def _build(out: Path) -> Path:
    import torch

    # One thread: the model is tiny, and OpenMP threads spin-wait badly beside a busy engine.
    torch.set_num_threads(1)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"Building the loragate demo model and adapters into {out} ...", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out.parent))
    try:
        base = tmp / BASE_DIRNAME
        tokenizer = _build_tokenizer(base)
        _build_base(base, tokenizer)
        for adapter in DEMO_ADAPTERS:
            _train_adapter(base, tokenizer, adapter.phrase, tmp / "adapters" / adapter.name)
        (tmp / RECIPE_FILENAME).write_text(recipe_hash())
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print("Demo ready.", flush=True)
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else default_demo_dir()
    build(out.expanduser().resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
