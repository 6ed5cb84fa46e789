"""Datature Vi runs served as the Vi SDK serves them (issue 27), on the real engine.

Run directories are built here, one per task type the Vi SDK knows, each with a ``run.json``
in the SDK's shape (``spec.flow.blocks``) and the vision demo's adapter as the run's adapter
(its base, the tiny Idefics3, as ``model_full``). One gateway boots: ``--run-id`` serves the
phrase-grounding run from the Vi SDK's own cache (``~/.datature/vi/models/RUN``, under a HOME
made for the test: no download, no credentials); the other runs are added one after another
through the admin API from what ``served_vi_run`` prepares (the adapter with the run's preset
as its ``loragate.json``). The witness that a prompt reached the model is the engine's own
count of the prompt it rendered (``usage.prompt_tokens``, against ``POST /tokenize``).
That a phrase-grounding run's answer validates against its task's schema needs a model that
writes sense (this one's weights are random): tests/integration/test_real_model.py checks it
on SmolLM2, the run put through the admin API.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.base_model.vi_runs import served_vi_run, vi_run_preset
from loragate.base_model.vi_tasks import VI_TASKS
from loragate.demo.layout import (
    VISION_ADAPTERS,
    VISION_DEMO_IMAGES,
    VISION_ENGINE_ARGS,
    demo_adapter_dir,
    demo_base_dir,
    ensure_vision_demo,
    vision_images_dir,
)
from tests.gateway_process import GatewayProcess
from tests.unit.test_vi_runs import flow_run_json

pytestmark = pytest.mark.engine

CACHED_RUN = "run-phrase-grounding"
OTHER_TASKS = ["vqa", "freeform", "video-freeform", "generic"]
OWN_SYSTEM_PROMPT = "You inspect solder joints on circuit boards."


def build_run(run_dir: Path, vision_demo: Path, info: dict[str, Any]) -> Path:
    """A Vi run as the SDK lays it out (downloader.py _find_model_paths)."""
    full = run_dir / "model_full"
    shutil.copytree(demo_base_dir(vision_demo), full)
    (full / "run.json").write_text(json.dumps(info))
    # The SDK's task prompts run to about 1,000 tokens, past the tiny model's 512 positions;
    # its weights are random, so more positions change nothing it knows.
    config = json.loads((full / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 4096
    (full / "config.json").write_text(json.dumps(config))
    shutil.copytree(
        demo_adapter_dir(vision_demo, VISION_ADAPTERS[0].name), run_dir / "model_adapter"
    )
    return run_dir


@pytest.fixture(scope="module")
def vision_demo() -> Path:
    return ensure_vision_demo()


@pytest.fixture(scope="module")
def image(vision_demo: Path) -> str:
    png = (vision_images_dir(vision_demo) / sorted(VISION_DEMO_IMAGES)[0]).read_bytes()
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, vision_demo: Path) -> Path:
    home = tmp_path_factory.mktemp("home")
    build_run(
        home / ".datature/vi/models" / CACHED_RUN, vision_demo, flow_run_json("phrase-grounding")
    )
    return home


@pytest.fixture(scope="module")
def vi_gateway(home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        cache_dir=tmp_path_factory.mktemp("vi-run-gateway"),
        args=["--run-id", CACHED_RUN, "--", *VISION_ENGINE_ARGS],
        env={
            "HOME": str(home),
            "DATATURE_VI_SECRET_KEY": "",
            "DATATURE_VI_ORGANIZATION_ID": "",
        },
    ).start()
    try:
        yield process.wait_ready(timeout=600)
    finally:
        process.stop()


def usage(gateway: GatewayProcess, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"max_tokens": 1, **body}, timeout=300
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def rendered(gateway: GatewayProcess, messages: list[dict[str, Any]]) -> int:
    body = {"model": f"{CACHED_RUN}-base", "messages": messages, "add_generation_prompt": True}
    answer = httpx.post(f"{gateway.url}/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["count"])


def check_run(gateway: GatewayProcess, name: str, info: dict[str, Any], image: str) -> None:
    """The run's preset is shown, its system prompt reaches the model, and a source-only
    request is asked the task's default prompt."""
    preset = vi_run_preset(info)
    shown = httpx.get(f"{gateway.url}/v1/models/{name}", timeout=30).json()["preset"]
    assert shown == preset
    hello = [{"role": "user", "content": "Hello"}]
    system = preset.get("system_prompt")
    expected = rendered(
        gateway, [{"role": "system", "content": system}, *hello] if system else hello
    )
    assert usage(gateway, {"model": name, "messages": hello})["usage"]["prompt_tokens"] == expected
    task = VI_TASKS[
        next(b for b in info["spec"]["flow"]["blocks"] if "dataset" in b["block"])["settings"][
            "projectKind"
        ]
    ]
    if task.user_prompt is None:
        return
    source_only = usage(gateway, {"model": name, "source": image})["usage"]["prompt_tokens"]
    asked = {"model": name, "source": image, "user_prompt": task.user_prompt}
    assert source_only == usage(gateway, asked)["usage"]["prompt_tokens"]
    other = usage(gateway, {**asked, "user_prompt": "Hi"})["usage"]["prompt_tokens"]
    assert other != source_only


def test_the_cached_phrase_grounding_run_is_served_as_vi_serves_it(
    vi_gateway: GatewayProcess, image: str
) -> None:
    check_run(vi_gateway, CACHED_RUN, flow_run_json("phrase-grounding"), image)
    assert "from the Vi SDK's cache" in vi_gateway.log_path.read_text()


@pytest.mark.parametrize("task", OTHER_TASKS)
def test_a_run_of_each_task_type_is_served_with_its_preset(
    vi_gateway: GatewayProcess, vision_demo: Path, image: str, tmp_path: Path, task: str
) -> None:
    system = OWN_SYSTEM_PROMPT if task == "vqa" else None  # the flow's own, over the task's
    info = flow_run_json(task, system_prompt=system)
    run = build_run(tmp_path / f"run-{task}", vision_demo, info)
    _base, adapter = served_vi_run(run, tmp_path / "served")
    name = f"run-{task}"
    put = vi_gateway.admin("PUT", f"/admin/adapters/{name}", json={"source": str(adapter)})
    assert put.status_code == 200, put.text
    try:
        check_run(vi_gateway, name, info, image)
    finally:
        vi_gateway.admin("DELETE", f"/admin/adapters/{name}")
