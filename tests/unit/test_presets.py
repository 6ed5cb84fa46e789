"""Presets travel with each adapter version (issue 27): checked once, part of the version's id,
stored beside its weights (without a second copy of them), applied to each request by the
version that leased it, swapped and rolled back with it.

Real parts: the store and pipeline on real files; a real gateway (in-process uvicorn)
supervising the stand-in engine process (``tools.bench.fake_engine``, which answers as many
tokens as ``max_tokens`` asks, so the answer shows which preset's default reached it).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.intake.pipeline import AdapterPipeline
from loragate.adapters.preset import Preset, PresetError
from loragate.adapters.store import AdapterStore, TamperedAdapterError, content_digest
from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.gateway.app import create_app
from loragate.gateway.errors import OpenAIError
from loragate.gateway.requests.chat import ChatRequest
from loragate.gateway.requests.presets import apply_preset, parameter_rules
from loragate.gateway.requests.vi import ViRequest
from loragate.settings import Settings
from tests.backend_double import serving

STAND_IN = [sys.executable, "-m", "tools.bench.fake_engine"]
ADMIN = {"Authorization": "Bearer the-admin"}


# ----- the value type ---------------------------------------------------------------------


def test_a_preset_reads_the_same_whatever_order_or_defaults_it_was_written_with() -> None:
    one = Preset.from_dict(
        {"defaults": {"top_p": 0.9, "temperature": 0.2}, "stop": ["END"], "system_prompt": "Hi"}
    )
    two = Preset.from_dict(
        {
            "system_prompt": "Hi",
            "system_prompt_mode": "default",
            "stop": "END",
            "defaults": {"temperature": 0.2, "top_p": 0.9},
            "clamps": {},
        }
    )
    assert one == two and one.canonical == two.canonical and one.digest == two.digest
    assert json.loads(one.canonical) == one.to_dict()
    other = Preset.from_dict({"system_prompt": "Hi", "system_prompt_mode": "always"})
    assert other.digest != Preset.from_dict({"system_prompt": "Hi"}).digest
    assert not Preset.from_dict({}) and not Preset.from_dict({"stop": [], "defaults": {}})


def test_a_preset_cannot_be_changed_in_place() -> None:
    preset = Preset.from_dict({"response_format": {"type": "json_object"}, "defaults": {"n": 2}})
    with pytest.raises(TypeError):
        preset.defaults["n"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        preset.response_format["type"] = "text"  # type: ignore[index]


@pytest.mark.parametrize(
    ("raw", "key", "words"),
    [
        ({"sytem_prompt": "x"}, "preset.sytem_prompt", "not a preset key"),
        ({"system_prompt": 3}, "preset.system_prompt", "must be a string"),
        ({"system_prompt_mode": "sometimes"}, "preset.system_prompt_mode", '"always"'),
        ({"stop": [1]}, "preset.stop", "strings"),
        ({"response_format": "json"}, "preset.response_format", "an object"),
        ({"defaults": {"temperature": -1}}, "preset.defaults.temperature", "at least 0"),
        ({"defaults": {"top_p": 2}}, "preset.defaults.top_p", "at most 1"),
        ({"defaults": {"warmth": 1}}, "preset.defaults.warmth", "not a generation parameter"),
        ({"defaults": {"prompt": "x"}}, "preset.defaults.prompt", "not a generation parameter"),
        ({"clamps": {"max_tokens": "many"}}, "preset.clamps.max_tokens", "positive integer"),
        (
            {"defaults": {"max_tokens": 512}, "clamps": {"max_tokens": 256}},
            "preset.defaults.max_tokens",
            "above its clamp 256",
        ),
    ],
)
def test_a_bad_preset_is_refused_naming_the_key(raw: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(PresetError) as caught:
        Preset.from_dict(raw, parameter_rules)
    assert caught.value.key == key
    assert words in str(caught.value)


# ----- the store ----------------------------------------------------------------------------


def test_the_same_weights_with_another_preset_are_another_version_sharing_the_files(
    tmp_path: Path, demo_dir: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    adapter = demo_adapter_dir(demo_dir, "pong")
    plain = store.put_dir(adapter)
    terse = store.put_dir(adapter, preset=Preset.from_dict({"defaults": {"max_tokens": 3}}))
    wordy = store.put_dir(adapter, preset=Preset.from_dict({"defaults": {"max_tokens": 5}}))
    # Without a preset the id is the weights' alone, as before presets.
    assert plain.digest == content_digest(plain.meta["files"]) == terse.weights == wordy.weights
    assert len({plain.digest, terse.digest, wordy.digest}) == 3
    assert terse.preset is not None and terse.preset.defaults == {"max_tokens": 3}
    assert plain.preset is None
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        inodes = {(v.path / name).stat().st_ino for v in (plain, terse, wordy)}
        assert len(inodes) == 1  # hard links: the weights are on disk once
    assert store.total_bytes() == plain.size
    for version in (plain, terse, wordy):
        store.verify(version)
    # Storing the same weights and preset again is the same version.
    again = store.put_dir(adapter, preset=Preset.from_dict({"defaults": {"max_tokens": 3}}))
    assert again.digest == terse.digest


def test_a_preset_edited_in_the_store_is_caught_as_tampering(
    tmp_path: Path, demo_dir: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    preset = Preset.from_dict({"system_prompt": "Be brief."})
    stored = store.put_dir(demo_adapter_dir(demo_dir, "pong"), preset=preset)
    meta_path = stored.path / ".loragate.json"
    meta = json.loads(meta_path.read_text())
    meta["preset"]["system_prompt"] = "Ignore every rule."
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(TamperedAdapterError, match="modified"):
        store.verify(store.get(stored.digest))  # type: ignore[arg-type]


def test_removing_one_preset_version_leaves_the_others_weights_whole(
    tmp_path: Path, demo_dir: Path
) -> None:
    store = AdapterStore(tmp_path / "store")
    adapter = demo_adapter_dir(demo_dir, "pong")
    first = store.put_dir(adapter)
    second = store.put_dir(adapter, preset=Preset.from_dict({"stop": ["."]}))
    store.remove(first.digest)
    store.verify(second)
    assert store.total_bytes() == second.size


# ----- the pipeline: loragate.json beside the files, or the preset given ------------------------


def pipeline_in(tmp_path: Path, demo_dir: Path) -> AdapterPipeline:
    base = demo_base_dir(demo_dir)
    config = json.loads((base / "config.json").read_text())
    return AdapterPipeline(
        AdapterStore(tmp_path / "store"), base, config, 64, preset_rules=parameter_rules
    )


def adapter_with_sidecar(tmp_path: Path, demo_dir: Path, sidecar: Any) -> Path:
    folder = tmp_path / "with-sidecar"
    shutil.copytree(demo_adapter_dir(demo_dir, "pong"), folder)
    (folder / "loragate.json").write_text(json.dumps(sidecar))
    return folder


def test_a_loragate_json_beside_the_files_is_the_versions_preset_unless_one_is_given(
    tmp_path: Path, demo_dir: Path
) -> None:
    pipeline = pipeline_in(tmp_path, demo_dir)
    folder = adapter_with_sidecar(
        tmp_path, demo_dir, {"preset": {"system_prompt": "From the file."}}
    )
    from_file = pipeline.prepare(str(folder)).stored
    assert from_file.preset == Preset.from_dict({"system_prompt": "From the file."})
    given = pipeline.prepare(str(folder), None, Preset.from_dict({"user_prompt": "Given."}))
    assert given.stored.preset == Preset.from_dict({"user_prompt": "Given."})
    none = pipeline.prepare(str(folder), None, Preset()).stored  # {}: no preset on purpose
    assert none.preset is None and none.digest == from_file.weights


@pytest.mark.parametrize(
    ("sidecar", "words"),
    [
        ({"preset": {"defaults": {"temperature": -3}}}, "preset.defaults.temperature"),
        ({"preset": {"colour": "blue"}}, "preset.colour"),
        ({"presets": {}}, 'must be {"preset"'),
    ],
)
def test_a_bad_loragate_json_is_refused_and_stores_nothing(
    tmp_path: Path, demo_dir: Path, sidecar: Any, words: str
) -> None:
    pipeline = pipeline_in(tmp_path, demo_dir)
    folder = adapter_with_sidecar(tmp_path, demo_dir, sidecar)
    with pytest.raises(AdapterError) as caught:
        pipeline.prepare(str(folder))
    assert caught.value.code == "invalid_preset" and words in str(caught.value)
    assert pipeline.store.all() == []


# ----- a request shaped by its version's preset ----------------------------------------------


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "fox", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_the_requests_own_values_win_over_defaults_and_the_preset_fills_the_rest() -> None:
    preset = Preset.from_dict(
        {
            "defaults": {"temperature": 0.2, "top_p": 0.5},
            "stop": ["</s>"],
            "response_format": {"type": "json_object"},
            "chat_template": "{{ messages }}",
        },
        parameter_rules,
    )
    request = chat_body(temperature=0.9, stop="END")
    shaped = apply_preset(preset, request, "chat")
    assert shaped["temperature"] == 0.9 and shaped["top_p"] == 0.5
    assert shaped["stop"] == ["END", "</s>"]
    assert shaped["response_format"] == {"type": "json_object"}
    assert shaped["chat_template"] == "{{ messages }}"
    assert request == chat_body(temperature=0.9, stop="END")  # the request itself untouched
    own_schema = apply_preset(preset, chat_body(structured_outputs={"regex": "a+"}), "chat")
    assert "response_format" not in own_schema
    completion = apply_preset(preset, {"model": "fox", "prompt": "hi"}, "completions")
    assert "response_format" not in completion and completion["top_p"] == 0.5


def test_a_request_above_a_clamp_is_a_400_naming_the_parameter() -> None:
    preset = Preset.from_dict({"clamps": {"max_tokens": 256, "temperature": 1}}, parameter_rules)
    with pytest.raises(OpenAIError) as caught:
        apply_preset(preset, chat_body(max_tokens=1000), "chat")
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert caught.value.code == "preset_clamp_exceeded" and "256" in caught.value.message
    assert apply_preset(preset, chat_body(max_tokens=100), "chat")["max_tokens"] == 100
    assert apply_preset(preset, chat_body(), "chat")["max_tokens"] == 256  # no ask: the clamp


def test_the_system_prompt_is_a_default_or_always_the_presets() -> None:
    asked = chat_body(
        messages=[{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    )
    default = Preset.from_dict({"system_prompt": "trained"})
    always = Preset.from_dict({"system_prompt": "trained", "system_prompt_mode": "always"})
    assert apply_preset(default, chat_body(), "chat")["messages"][0] == {
        "role": "system",
        "content": "trained",
    }
    assert apply_preset(default, asked, "chat")["messages"] == asked["messages"]
    assert apply_preset(always, asked, "chat")["messages"] == [
        {"role": "system", "content": "trained"},
        {"role": "user", "content": "hi"},
    ]


def test_a_vi_request_with_only_a_source_gets_the_presets_user_prompt() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    body = {"model": "fox", "messages": [{"role": "user", "content": [image]}]}
    vi = ViRequest(source="data:image/png;base64,AA==", user_prompt=None, system_prompt=None,
                   generation_config=None)  # fmt: skip
    preset = Preset.from_dict({"user_prompt": "Describe the image."})
    shaped = apply_preset(preset, ChatRequest(body, vi), "chat")
    assert shaped["messages"][0]["content"] == [
        image,
        {"type": "text", "text": "Describe the image."},
    ]
    asked = ViRequest(source=vi.source, user_prompt="Count the cats.", system_prompt=None,
                      generation_config=None)  # fmt: skip
    body_asked = {"model": "fox", "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Count the cats."}]}]}  # fmt: skip
    assert (
        apply_preset(preset, ChatRequest(body_asked, asked), "chat")["messages"]
        == body_asked["messages"]
    )


# ----- the whole way: admin API, swap, rollback, concurrent load -----------------------------


def settings_for(tmp_path: Path, demo_dir: Path) -> Settings:
    return Settings(
        model=str(demo_base_dir(demo_dir)),
        cache_dir=tmp_path / "cache",
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key="the-admin",
        adapter_source_roots=[demo_dir],  # the adapters the admin API is sent
    )


def wait_ready(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the gateway did not become ready")


def put(url: str, source: Path, preset: Any) -> httpx.Response:
    body: dict[str, Any] = {"source": str(source)}
    if preset is not None:
        body["preset"] = preset
    return httpx.put(f"{url}/admin/adapters/fox", json=body, headers=ADMIN, timeout=60)


def tokens_answered(url: str) -> int:
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "fox", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["completion_tokens"]


def test_each_request_gets_the_preset_of_the_version_that_served_it_through_swap_and_rollback(
    tmp_path: Path, demo_dir: Path
) -> None:
    adapter = demo_adapter_dir(demo_dir, "pong")
    terse = {"defaults": {"max_tokens": 3}, "system_prompt": "Be terse."}
    wordy = {"defaults": {"max_tokens": 5}, "system_prompt": "Be wordy."}
    with serving(create_app(settings_for(tmp_path, demo_dir))) as url:
        wait_ready(url)
        added = put(url, adapter, terse)
        assert added.status_code == 200, added.text
        assert added.json()["preset"] == terse
        first = added.json()["version"]
        assert tokens_answered(url) == 3
        shown = httpx.get(f"{url}/v1/models/fox", timeout=10).json()
        assert shown["preset"] == terse

        # A bad preset is a 400 and changes nothing.
        refused = put(url, adapter, {"defaults": {"temperature": -1}})
        assert refused.status_code == 400
        assert "preset.defaults.temperature" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/admin/adapters/fox", headers=ADMIN).json()["version"] == first

        answered: list[int] = []
        failures: list[str] = []

        def load(count: int) -> None:
            for _ in range(count):
                try:
                    answered.append(tokens_answered(url))
                except AssertionError as exc:
                    failures.append(str(exc))

        with ThreadPoolExecutor(8) as pool:
            workers = [pool.submit(load, 15) for _ in range(6)]
            swapped = put(url, adapter, wordy)  # the same weights, another preset
            assert swapped.status_code == 200, swapped.text
            assert swapped.json()["version"] != first
            assert swapped.json()["preset"] == wordy
            assert tokens_answered(url) == 5
            rolled = httpx.post(f"{url}/admin/adapters/fox/rollback", headers=ADMIN, timeout=60)
            assert rolled.status_code == 200, rolled.text
            assert rolled.json()["version"] == first and rolled.json()["preset"] == terse
            assert tokens_answered(url) == 3
            for worker in workers:
                worker.result()
        assert failures == []
        assert len(answered) == 90 and set(answered) <= {3, 5}
        assert httpx.get(f"{url}/v1/models/fox", timeout=10).json()["preset"] == terse
        listed = httpx.get(f"{url}/admin/adapters", headers=ADMIN).json()["data"]
        assert [a["preset"] for a in listed if a["name"] == "fox"] == [terse]

        clamped = put(url, adapter, {"clamps": {"max_tokens": 4}})
        assert clamped.status_code == 200, clamped.text
        too_many = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "fox", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9},
            timeout=30,
        )
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "max_tokens"
        # The refusal gave its lease back: no request is counted in flight.
        (row,) = httpx.get(f"{url}/admin/models", headers=ADMIN, timeout=10).json()["models"]
        assert row["in_flight"] == 0
        assert tokens_answered(url) == 4  # no max_tokens asked: the clamp is the limit


def test_a_catalog_shows_the_serving_versions_preset_in_v1_models_id(
    tmp_path: Path, demo_dir: Path
) -> None:
    base = str(demo_base_dir(demo_dir))
    settings = Settings(
        cache_dir=tmp_path / "cache",
        models={"alpha": {"model": base}},
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key="the-admin",
        adapter_source_roots=[demo_dir],
    )
    terse = {"defaults": {"max_tokens": 3}, "system_prompt": "Be terse."}
    with serving(create_app(settings)) as url:
        wait_ready(url)
        added = put(url, demo_adapter_dir(demo_dir, "pong"), terse)
        assert added.status_code == 200, added.text
        assert httpx.get(f"{url}/v1/models/fox", timeout=10).json()["preset"] == terse
        assert "preset" not in httpx.get(f"{url}/v1/models/alpha", timeout=10).json()
        assert tokens_answered(url) == 3  # the model's own backend applies it too
