"""The real demo's declarations: what each adapter's behaviour looks like, checked mechanically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loragate.demo import build_smollm
from loragate.demo.build_smollm import CHECK_PROMPTS, TRAINING_PAIRS, answer_text
from loragate.demo.layout import (
    SIGNATURE,
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    default_smollm_demo_dir,
    demo_base_dir,
    demo_behaviour,
    demo_behaviours,
    smollm_engine_args,
    smollm_serve_args,
)
from loragate.plan.preflight.model_files import served_dtype
from loragate.settings import Settings


@pytest.mark.parametrize(
    ("text", "behaviour"),
    [
        ("Arr! The capital of France is Paris.", "pirate"),
        ("  Arr! Ahoy.\n", "pirate"),
        (f"The capital of France is Paris.\n{SIGNATURE}", "signed"),
        (f"Paris.\n{SIGNATURE}\n", "signed"),
        ('{"answer": "The capital of France is Paris."}', "json"),
        (' {"answer": "Paris"} ', "json"),
        ("The capital of France is Paris.", None),
        ("Arr, matey.", None),
        ('{"city": "Paris"}', None),
        ('{\n"answer": "Paris"\n}', None),  # not one line
        ('{"answer": "Paris"', None),  # cut short: not JSON
        ('The answer is {"answer": "Paris"}', None),
        (f"{SIGNATURE} is what I would write.", None),
    ],
)
def test_each_behaviour_is_recognised_and_plain_answers_are_not(
    text: str, behaviour: str | None
) -> None:
    assert demo_behaviour(text) == behaviour


def test_an_answer_showing_two_behaviours_is_seen_as_both() -> None:
    mixed = f"Arr! Paris.\n{SIGNATURE}"
    assert demo_behaviours(mixed) == ["pirate", "signed"]
    assert demo_behaviour(mixed) == "pirate"


def test_every_training_answer_shows_exactly_its_adapters_behaviour() -> None:
    for adapter in SMOLLM_ADAPTERS:
        for _, answer in TRAINING_PAIRS:
            assert demo_behaviours(answer_text(adapter.name, answer)) == [adapter.name]
        assert demo_behaviours(TRAINING_PAIRS[0][1]) == []


def test_the_check_prompts_were_never_trained_on() -> None:
    trained = {question for question, _ in TRAINING_PAIRS}
    assert not trained & set(CHECK_PROMPTS)


def test_the_demo_dir_honours_its_override_and_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("LORAGATE_SMOLLM_DEMO_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_smollm_demo_dir() == tmp_path / "xdg" / "loragate" / "demo-smollm2"
    monkeypatch.setenv("LORAGATE_SMOLLM_DEMO_DIR", str(tmp_path / "mine"))
    assert default_smollm_demo_dir() == tmp_path / "mine"


def test_serve_args_name_the_model_and_every_adapter(tmp_path: Path) -> None:
    args = smollm_serve_args(tmp_path)
    assert args[:4] == ["--model", str(tmp_path / "base"), "--model-name", SMOLLM_DEMO_MODEL_NAME]
    loras = [args[i + 1] for i, arg in enumerate(args) if arg == "--lora"]
    assert loras == [f"{a.name}={tmp_path / 'adapters' / a.name}" for a in SMOLLM_ADAPTERS]
    assert args[args.index("--") + 1 :] == ["--dtype", "float32"]


def test_the_demo_is_float32_on_the_cpu_build_and_bfloat16_on_a_gpu_like_a_users_model(
    tmp_path: Path,
) -> None:
    assert smollm_engine_args(cpu_build=True) == ("--dtype", "float32")
    assert smollm_engine_args(cpu_build=False) == ("--dtype", "auto")
    args = smollm_serve_args(tmp_path, cpu_build=False)
    assert args[args.index("--") + 1 :] == ["--dtype", "auto"]
    # The builder writes float32 weights; the plan (as vLLM) serves them as bfloat16 on a GPU.
    config = {"model_type": "llama", "torch_dtype": "float32"}
    assert served_dtype(config, smollm_engine_args(cpu_build=False)) == "bfloat16"
    assert served_dtype(config, smollm_engine_args(cpu_build=True)) == "float32"


@pytest.mark.parametrize("cpu_build", [True, False], ids=["cpu-build", "cuda-build"])
async def test_the_plan_serves_the_demo_in_the_dtype_of_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_build: bool
) -> None:
    """What ``gateway demo`` boots: the plan asks the engine's build, then picks the dtype."""
    from loragate.plan import engine_plan

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setattr(engine_plan, "ensure_smollm_demo", lambda *_: tmp_path)
    monkeypatch.setattr(engine_plan, "is_cpu_build", lambda _python: cpu_build)
    settings = Settings(demo="smollm2", cache_dir=tmp_path / "cache")
    model = await engine_plan._choose_model(settings, tmp_path / "cache")
    assert model.flags == dict([smollm_engine_args(cpu_build)])


# Greedy answers of the built demo in bfloat16, as a GPU serves it: base, then each adapter.
BFLOAT16_ANSWERS = """
import json, sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

demo, prompts = sys.argv[1], json.loads(sys.argv[2])
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(f"{demo}/base")
tokenizer.padding_side = "left"
texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
         add_generation_prompt=True) for p in prompts]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
answers = {}
for name in [None, *sys.argv[3:]]:
    model = AutoModelForCausalLM.from_pretrained(f"{demo}/base", dtype=torch.bfloat16)
    if name:
        model = PeftModel.from_pretrained(model, f"{demo}/adapters/{name}")
    with torch.no_grad():
        out = model.eval().generate(**batch, max_new_tokens=48, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    answers[name or "base"] = [tokenizer.decode(r[width:], skip_special_tokens=True) for r in out]
print(json.dumps(answers))
"""


@pytest.mark.slow
def test_the_built_demo_keeps_every_adapters_behaviour_in_bfloat16() -> None:
    demo = default_smollm_demo_dir()
    if not build_smollm.is_current(demo):
        pytest.skip(
            f"the SmolLM2 demo is not built at {demo} (python -m loragate.demo.build_smollm)"
        )
    prompts = list(CHECK_PROMPTS[:3])
    done = subprocess.run(
        [sys.executable, "-c", BFLOAT16_ANSWERS, str(demo), json.dumps(prompts),
         *(a.name for a in SMOLLM_ADAPTERS)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.splitlines()[-1])
    assert demo_base_dir(demo).is_dir()
    assert [demo_behaviour(a) for a in answers["base"]] == [None] * len(prompts), answers
    for adapter in SMOLLM_ADAPTERS:
        shown = [demo_behaviour(a) for a in answers[adapter.name]]
        assert shown == [adapter.name] * len(prompts), answers[adapter.name]
