"""The real demo's declarations: what each adapter's behaviour looks like, checked mechanically."""

from __future__ import annotations

from pathlib import Path

import pytest

from loragate.demo.build_smollm import CHECK_PROMPTS, TRAINING_PAIRS, answer_text
from loragate.demo.layout import (
    SIGNATURE,
    SMOLLM_ADAPTERS,
    SMOLLM_DEMO_MODEL_NAME,
    default_smollm_demo_dir,
    demo_behaviour,
    demo_behaviours,
    smollm_serve_args,
)


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
