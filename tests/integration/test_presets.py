"""Presets on the real engine (issue 27): the version that serves a request shapes it.

An adapter is added with a preset through the admin API, swapped to a version with another
preset (the same weights) and rolled back while clients keep asking: each answer carries the
witness of the preset that shaped it. The witness is the engine's own count of tokens: the
prompt it rendered (``usage.prompt_tokens``, equal to what ``POST /tokenize`` renders for the
request's messages with that preset's system prompt in front) and the tokens it generated
(the preset's ``max_tokens`` default, with ``ignore_eos`` so the tiny model never stops
early). The suite's shared gateway serves it, under an adapter name no other test uses,
removed at the end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.engine

BASE = "loragate-demo"
NAME = "preset-probe"
MESSAGES = [{"role": "user", "content": "Hello"}]
TERSE = {
    "system_prompt": "Be terse.",
    "defaults": {"max_tokens": 3, "ignore_eos": True, "temperature": 0},
    "clamps": {"max_tokens": 8},
}
WORDY = {
    "system_prompt": "You are a wordy assistant: explain every answer at great length.",
    "defaults": {"max_tokens": 5, "ignore_eos": True, "temperature": 0},
}


def rendered_count(gateway: GatewayProcess, messages: list[dict[str, Any]]) -> int:
    """How many tokens the engine renders ``messages`` to, with the generation prompt."""
    body = {"model": BASE, "messages": messages, "add_generation_prompt": True}
    answer = httpx.post(f"{gateway.url}/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["count"])


def usage_of(gateway: GatewayProcess, **extra: Any) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of one chat request to the probe adapter."""
    body = {"model": NAME, "messages": MESSAGES, **extra}
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"]


def put_probe(gateway: GatewayProcess, source: Path, preset: dict[str, Any]) -> dict[str, Any]:
    answer = gateway.admin(
        "PUT", f"/admin/adapters/{NAME}", json={"source": str(source), "preset": preset}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "ready" and answer.json()["preset"] == preset
    return answer.json()


def test_each_request_gets_the_preset_of_the_version_that_served_it_on_the_real_engine(
    gateway: GatewayProcess, demo_dir: Path
) -> None:
    pong = demo_dir / "adapters" / "pong"
    with_system = {
        preset["system_prompt"]: [{"role": "system", "content": preset["system_prompt"]}, *MESSAGES]
        for preset in (TERSE, WORDY)
    }
    bare = rendered_count(gateway, MESSAGES)
    terse_prompt = rendered_count(gateway, with_system[TERSE["system_prompt"]])
    wordy_prompt = rendered_count(gateway, with_system[WORDY["system_prompt"]])
    assert bare < terse_prompt < wordy_prompt  # three different renderings, told apart
    terse, wordy = (terse_prompt, 3), (wordy_prompt, 5)
    try:
        first = put_probe(gateway, pong, TERSE)["version"]
        # The preset's system prompt reached the model: the engine rendered it in front.
        assert usage_of(gateway) == terse
        assert httpx.get(f"{gateway.url}/v1/models/{NAME}", timeout=30).json()["preset"] == TERSE
        # The request's own system prompt wins over a "default" one; its max_tokens too.
        own = [{"role": "system", "content": "Be terse."}, *MESSAGES]
        assert usage_of(gateway, messages=own, max_tokens=2) == (terse_prompt, 2)

        # A request above a clamp is a 400 naming the parameter, and the engine never sees it.
        refused = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": NAME, "messages": MESSAGES, "max_tokens": 9},
            timeout=60,
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "max_tokens" and "max_tokens" in error["message"]

        stop = threading.Event()
        seen: Counter[tuple[int, int]] = Counter()
        failures: list[str] = []

        def client() -> None:
            while not stop.is_set():
                try:
                    seen[usage_of(gateway)] += 1
                except (AssertionError, httpx.HTTPError) as exc:
                    failures.append(str(exc))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1)
            second = put_probe(gateway, pong, WORDY)["version"]  # the same weights
            assert second != first
            assert usage_of(gateway) == wordy
            time.sleep(1)
            rolled = gateway.admin("POST", f"/admin/adapters/{NAME}/rollback")
            assert rolled.status_code == 200, rolled.text
            assert rolled.json()["version"] == first and rolled.json()["preset"] == TERSE
            assert usage_of(gateway) == terse
            time.sleep(1)
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
        assert failures == []
        # Every answer is one preset's, whole: never a mix of one's prompt and the other's length.
        assert set(seen) <= {terse, wordy}, seen
        assert seen[terse] > 0 and seen[wordy] > 0, seen
        assert httpx.get(f"{gateway.url}/v1/models/{NAME}", timeout=30).json()["preset"] == TERSE
    finally:
        gateway.admin("DELETE", f"/admin/adapters/{NAME}")
