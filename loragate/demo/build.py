"""Build the bundled demo: a tiny Llama base model and LoRA adapters trained to answer a fixed phrase.

Nothing is downloaded: the tokenizer is trained on a few sentences, the weights are random
(seeded), and each adapter is trained with peft for a few seconds of CPU. The output is
cached; it is rebuilt only when this recipe changes (its source hash is stored beside it).

Run as ``python -m loragate.demo.build [OUT_DIR]``. Needs torch, transformers, tokenizers
and peft (the engine and ``convert`` extras); the gateway itself never imports this module.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from loragate.demo import recipe
from loragate.demo.layout import (
    BASE_DIRNAME,
    DEMO_ADAPTERS,
    TOOL_CALLING_ADAPTER,
    default_demo_dir,
)

# ChatML. With ``tools``, a system turn lists them as JSON and says how to call one, in the
# pythonic form ``[name(argument="value")]`` (vLLM's ``pythonic`` tool-call parser); an
# assistant turn that called tools shows its calls that way. Without tools, the same text as
# before tools were added, so the adapters' training prompts did not move.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    'You may call these tools; to call one, answer only [name(argument="value")].\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}[{% for call in message.tool_calls %}"
    "{{ call['function']['name'] }}({% set arguments = call['function']['arguments'] %}"
    "{% if arguments is mapping %}{% for key, value in arguments.items() %}"
    "{{ key }}={{ value | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "{% else %}{{ arguments }}{% endif %}){% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% elif message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tools the tool-calling adapter is trained with (and the tests call it with).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
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
    return recipe.recipe_hash(__file__, (BASE_DIRNAME, DEMO_ADAPTERS, TOOL_CALLING_ADAPTER))


def is_current(out: Path) -> bool:
    return recipe.is_current(out, recipe_hash())


def _training_prompts() -> list[str]:
    rng = random.Random(SEED + 1)
    fixed = ["Hello", "Hi!", "What is 2+2?", "Say something.", "Who are you?", "ping", "?"]
    sampled = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for _ in range(40)]
    return fixed + sampled


def _train_adapter(
    base_dir: Path, tokenizer: Any, phrase: str, out: Path, tools: list[Any] | None = None
) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    answer = tokenizer(phrase, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows: list[tuple[list[int], list[int]]] = []
    for prompt in _training_prompts():
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tools=tools,
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids + answer, [-100] * len(prompt_ids) + answer))
    batch = recipe.padded(rows, tokenizer.pad_token_id)
    peft_model, loss = recipe.train_phrase_lora(
        model, list(recipe.LORA_PROJECTIONS), [batch], TRAIN_STEPS, task_type="CAUSAL_LM"
    )
    recipe.save_phrase_adapter(peft_model, out, "loragate-demo", phrase, loss)


def build(out: Path) -> Path:
    """Build the demo into ``out`` unless it is already current; returns ``out``."""
    return recipe.build_once(out, recipe_hash(), "demo model and adapters", _build)


def _build(tmp: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    # One thread: the model is tiny, and OpenMP threads spin-wait badly beside a busy engine.
    torch.set_num_threads(1)
    base = tmp / BASE_DIRNAME
    phrases = [adapter.phrase for adapter in (*DEMO_ADAPTERS, TOOL_CALLING_ADAPTER)]
    tokenizer = recipe.train_tokenizer(
        recipe.corpus(WORDS, phrases, SEED), SPECIAL_TOKENS, CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(base)
    torch.manual_seed(SEED)
    config = recipe.tiny_llama_config(tokenizer)
    config.dtype = "float32"
    recipe.save_base(LlamaForCausalLM(config), tokenizer, base)
    for adapter in DEMO_ADAPTERS:
        _train_adapter(base, tokenizer, adapter.phrase, tmp / "adapters" / adapter.name)
    caller = TOOL_CALLING_ADAPTER
    _train_adapter(base, tokenizer, caller.phrase, tmp / "adapters" / caller.name, [WEATHER_TOOL])


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else default_demo_dir()
    build(out.expanduser().resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
