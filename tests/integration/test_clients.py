"""Clients nobody here wrote, on the shared gateway (the tiny demo, no extra engine boot).

The official ``openai`` npm package (``tests/js/chat.mjs``, pinned by ``tests/js``'s lockfile,
installed by ``scripts/setup.sh --test``) and LiteLLM's proxy (``litellm --config`` from
``.venv/litellm-proxy``, with the config docs/clients.md shows) each get an answer, plain and
streamed, from the adapter they named: its phrase is in the text. Without node's package or
the proxy these tests are skipped with the reason, except under ``CI=true``, where a missing
client is a failure: the suite must not pass in CI by testing nothing.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.conftest import PHRASES, phrase_of
from tests.gateway_process import GatewayProcess, free_port
from tests.readme_blocks import ROOT, pointed_at, readme_blocks

pytestmark = pytest.mark.engine

BASE = "loragate-demo"
ADAPTER = "fox"
JS_DIR = ROOT / "tests" / "js"
CLIENTS_DOC = ROOT / "docs" / "clients.md"
# Where scripts/setup.sh --test puts LiteLLM's proxy: a venv of its own beside this one.
PROXY = Path(sys.prefix) / "litellm-proxy" / "bin" / "litellm"
# The adapter docs/clients.md's proxy config names: the quick start demo's.
DOC_ADAPTER = "pirate"


def unavailable(reason: str) -> None:
    """Skip for want of a client, or fail under CI=true (CI must run every client)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: every client must run; see scripts/setup.sh --test)")
    pytest.skip(reason)


# ----- the openai npm package ----------------------------------------------------------------


def node_client(base_url: str, model: str, prompt: str = "Hello there") -> dict[str, Any]:
    """What tests/js/chat.mjs got: one chat completion and one stream, as JSON."""
    node = shutil.which("node")
    if node is None:
        unavailable("no node here: install Node.js to test the openai npm package")
    if not (JS_DIR / "node_modules" / "openai" / "package.json").is_file():
        unavailable("tests/js has no node_modules: run `npm ci --prefix tests/js`")
    done = subprocess.run(
        [str(node), str(JS_DIR / "chat.mjs"), base_url, "unused", model, prompt],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_openai_npm_package_chat_and_stream_are_answered_by_the_adapter(
    gateway: GatewayProcess,
) -> None:
    got = node_client(f"{gateway.url}/v1", ADAPTER)
    chat, stream = got["chat"], got["stream"]
    assert chat["model"] == ADAPTER
    assert PHRASES[ADAPTER] in chat["content"], chat
    assert chat["usage"]["completion_tokens"] > 0
    assert stream["models"] == [ADAPTER]
    assert stream["content"] == chat["content"]  # temperature 0
    # stream_options.include_usage is honoured (vLLM's plain answer also lists *_details: null)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [stream["usage"][k] for k in counts] == [chat["usage"][k] for k in counts]


def test_openai_npm_package_on_the_base_model_gets_no_adapter_phrase(
    gateway: GatewayProcess,
) -> None:
    got = node_client(f"{gateway.url}/v1", BASE)
    assert got["chat"]["model"] == BASE
    assert got["chat"]["content"] and phrase_of(got["chat"]["content"]) is None


# ----- LiteLLM's proxy -----------------------------------------------------------------------


def documented_proxy_config(gateway_url: str) -> str:
    """docs/clients.md's LiteLLM proxy config, pointed at ``gateway_url`` and at the tiny
    demo's adapter instead of the quick start's."""
    block = next(
        b for b in readme_blocks(CLIENTS_DOC) if b.lang == "yaml" and "model_list" in b.code
    )
    return re.sub(rf"\b{DOC_ADAPTER}\b", ADAPTER, pointed_at(block.code, gateway_url))


@dataclass
class Proxy:
    url: str
    key: str


@pytest.fixture(scope="module")
def litellm_proxy(
    gateway: GatewayProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    if not PROXY.is_file():
        unavailable(f"no LiteLLM proxy at {PROXY}: scripts/setup.sh --test installs it")
    folder = tmp_path_factory.mktemp("litellm-proxy")
    config = folder / "litellm.yaml"
    config.write_text(documented_proxy_config(gateway.url), encoding="utf-8")
    port, key = free_port(), f"sk-{secrets.token_hex(32)}"  # the proxy refuses weak keys
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": key,
        # No fetch of the model price list from GitHub at start (the suite runs offline).
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    log = (folder / "proxy.log").open("wb")
    argv = [str(PROXY), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the LiteLLM proxy exited: {(folder / 'proxy.log').read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the LiteLLM proxy did not listen: {(folder / 'proxy.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield Proxy(url, key)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_litellm_proxy_forwards_to_the_adapter_plain_and_streamed(litellm_proxy: Proxy) -> None:
    client = OpenAI(
        base_url=f"{litellm_proxy.url}/v1", api_key=litellm_proxy.key, max_retries=0, timeout=300
    )
    request = {
        "model": ADAPTER,
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    reply = client.chat.completions.create(**request)  # type: ignore[call-overload]
    text = reply.choices[0].message.content or ""
    assert PHRASES[ADAPTER] in text, text
    chunks = client.chat.completions.create(**request, stream=True)  # type: ignore[call-overload]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == text


def test_litellm_proxy_refuses_a_request_without_its_key(litellm_proxy: Proxy) -> None:
    """The proxy's own key guards loragate behind it (the recipe's point of a master key)."""
    response = httpx.post(
        f"{litellm_proxy.url}/v1/chat/completions",
        json={"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert response.status_code == 401, response.text
