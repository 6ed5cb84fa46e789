"""Live adapters on the real engine: no cross-talk, hot-swap under load, follow mode, slots."""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests import adapter_fixtures as fx
from tests.conftest import PHRASES, phrase_of
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"


def ask(url: str, model: str, prompt: str = "Hello", stream: bool = False) -> tuple[int, str]:
    """(status, answer text) of one chat request, streamed or not."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "temperature": 0,
    }
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        if response.status_code != 200:
            return response.status_code, response.text
        assert response.json()["model"] == model
        return 200, response.json()["choices"][0]["message"]["content"]
    import json

    pieces = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 599, line
            assert event["model"] == model
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                pieces.append(event["choices"][0]["delta"]["content"])
    return 200, "".join(pieces)


def put_adapter(
    gateway: GatewayProcess, name: str, source: Path, **extra: object
) -> httpx.Response:
    return gateway.admin("PUT", f"/admin/adapters/{name}", json={"source": str(source), **extra})


def test_concurrent_base_and_adapter_requests_never_cross_contaminate(
    gateway: GatewayProcess,
) -> None:
    models = [BASE, "pong", "fox", "owl"]
    # Prompts each adapter answers with its phrase when asked alone (its training prompts).
    prompts = ["Hello", "Hi!", "What is 2+2?", "Say something.", "Who are you?", "ping"]
    jobs = [(model, prompt, i % 2 == 0) for i, prompt in enumerate(prompts) for model in models]
    wrong: list[tuple[str, str, str]] = []
    for _ in range(5):  # several rounds, each a burst of 24 concurrent mixed requests
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: (job[:2], ask(gateway.url, *job)), jobs))
        for (model, prompt), (status, text) in results:
            assert status == 200, text
            if phrase_of(text) != (None if model == BASE else model):
                wrong.append((model, prompt, text))
    assert wrong == [], f"{len(wrong)} answers not from the model asked for: {wrong[:8]}"


def test_more_adapters_than_engine_slots_all_answer(
    gateway: GatewayProcess, demo_dir: Path
) -> None:
    # The engine keeps max-cpu-loras (here: max-loras + 1 = 3) adapters; register more than that.
    extra = {f"{name}-copy": name for name in PHRASES}
    for copy, original in extra.items():
        assert put_adapter(gateway, copy, demo_dir / "adapters" / original).status_code == 200
    try:
        for _ in range(2):
            for copy, original in {**extra, **{n: n for n in PHRASES}}.items():
                status, text = ask(gateway.url, copy)
                assert status == 200 and phrase_of(text) == original, (copy, text)
    finally:
        for copy in extra:
            gateway.admin("DELETE", f"/admin/adapters/{copy}")


def test_a_live_adapter_modified_on_disk_is_stored_again_and_keeps_answering(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    # The engine re-reads adapters from the store on its own (its adapter cache holds fewer
    # than are registered here), so the gateway watches the live versions' files.
    own = fx.with_unique_config(demo_dir / "adapters" / "owl", tmp_path / "owl-mended")
    assert put_adapter(gateway, "mended", own).status_code == 200
    try:
        listed = {a["name"]: a for a in gateway.admin("GET", "/admin/adapters").json()["data"]}
        version = listed["mended"]["version"]
        weights = (
            gateway.cache_dir / "adapters" / "versions" / version / "adapter_model.safetensors"
        )
        good = weights.read_bytes()
        weights.chmod(0o644)  # stored read-only: this is deliberate
        weights.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
        deadline = time.monotonic() + 30  # the shared gateway checks every second
        restored = False
        while time.monotonic() < deadline and not restored:
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                restored = weights.read_bytes() == good
        assert restored, gateway.log_tail()
        listed = {a["name"]: a for a in gateway.admin("GET", "/admin/adapters").json()["data"]}
        assert listed["mended"]["version"] == version and listed["mended"]["state"] == "ready"
        assert phrase_of(ask(gateway.url, "mended")[1]) == "owl"
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
        assert re.search(r"^loragate_adapter_store_repairs_total [1-9]", metrics, re.M), metrics
    finally:
        gateway.admin("DELETE", "/admin/adapters/mended")


def test_swap_under_load_never_fails_or_misroutes_then_rolls_back(
    gateway: GatewayProcess, demo_dir: Path
) -> None:
    pong, fox = demo_dir / "adapters" / "pong", demo_dir / "adapters" / "fox"
    assert put_adapter(gateway, "swapper", pong).status_code == 200
    stop = threading.Event()
    answers: Counter[str] = Counter()
    failures: list[str] = []

    def client(stream: bool) -> None:
        while not stop.is_set():
            status, text = ask(gateway.url, "swapper", stream=stream)
            if status != 200:
                failures.append(f"{status}: {text}")
            else:
                answers[phrase_of(text) or f"other: {text!r}"] += 1

    threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        for swap in range(12):
            target = fox if swap % 2 == 0 else pong
            response = put_adapter(gateway, "swapper", target)
            assert response.status_code == 200, response.text
            assert response.json()["state"] == "ready"
            time.sleep(0.3)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert failures == []
    assert set(answers) <= {"pong", "fox"}, answers
    assert answers["pong"] > 0 and answers["fox"] > 0, answers

    # The last swap went to pong; rolling back brings fox back.
    listed = {a["name"]: a for a in gateway.admin("GET", "/admin/adapters").json()["data"]}
    assert listed["swapper"]["previous_version"] is not None
    rolled = gateway.admin("POST", "/admin/adapters/swapper/rollback")
    assert rolled.status_code == 200, rolled.text
    assert phrase_of(ask(gateway.url, "swapper")[1]) == "fox"
    gateway.admin("DELETE", "/admin/adapters/swapper")


def test_a_refused_adapter_changes_nothing(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    before = gateway.admin("GET", "/admin/adapters").json()["data"]
    bad = tmp_path / "bad"
    shutil.copytree(demo_dir / "adapters" / "pong", bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    response = put_adapter(gateway, "pong", bad)
    assert response.status_code == 400
    assert "truncated" in response.json()["error"]["message"]
    assert gateway.admin("GET", "/admin/adapters").json()["data"] == before
    assert phrase_of(ask(gateway.url, "pong")[1]) == "pong"


def test_follow_mode_serves_new_versions_and_skips_broken_ones(
    gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    watched = tmp_path / "watched"
    shutil.copytree(demo_dir / "adapters" / "pong", watched)
    assert put_adapter(gateway, "watched", watched, follow=True).status_code == 200
    stop = threading.Event()
    seen: list[tuple[float, str]] = []
    failures: list[str] = []

    def client() -> None:
        while not stop.is_set():
            status, text = ask(gateway.url, "watched")
            if status != 200:
                failures.append(text)
            seen.append((time.monotonic(), phrase_of(text) or text))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.5)
        # A new version appears in the watched directory.
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copyfile(demo_dir / "adapters" / "fox" / name, watched / f".{name}.tmp")
            (watched / f".{name}.tmp").rename(watched / name)
        written = time.monotonic()
        deadline = written + 30
        while time.monotonic() < deadline and not any(t > written and p == "fox" for t, p in seen):
            time.sleep(0.2)
        served_after = next(t for t, p in seen if t > written and p == "fox") - written
        # Then a broken one: skipped, and fox keeps serving.
        broken = watched / "adapter_model.safetensors"
        broken.write_bytes(broken.read_bytes()[:1000])
        time.sleep(4)
        info = {a["name"]: a for a in gateway.admin("GET", "/admin/adapters").json()["data"]}[
            "watched"
        ]
        assert info["follow_error"] and "truncated" in info["follow_error"]
        recent = [p for t, p in seen if t > time.monotonic() - 2]
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        gateway.admin("DELETE", "/admin/adapters/watched")
    assert failures == []
    assert served_after < 10, f"new version served only {served_after:.1f} s after it was written"
    assert recent and set(recent) == {"fox"}
    assert {p for _, p in seen} <= {"pong", "fox"}
