"""Every code block in the README and docs/ says how the suite runs it (or why it cannot)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from loragate.settings import load_settings
from tests.readme_blocks import KINDS, ROOT, blocks_of, readme_blocks
from tools.harness import free_port


def test_every_readme_block_says_how_it_is_tested() -> None:
    blocks = [block for block in readme_blocks() if block.lang]  # a bare fence holds text
    assert {block.page for block in blocks} >= {"README.md", "docs/api.md"}
    unmarked = [block.id for block in blocks if block.kind not in KINDS]
    assert not unmarked, f"code blocks without <!-- readme-test: KIND -->: {unmarked}"
    skipped = [block.id for block in blocks if block.kind == "skip" and not block.why]
    assert not skipped, f"code blocks skipped without saying why: {skipped}"


def test_the_runnable_blocks_are_found_wherever_they_moved() -> None:
    """The README's quick start keeps its demo example; the rest of each kind lives in docs/
    and is still found, so the integration tests run every one of them."""
    demo = blocks_of("demo")
    assert any(b.page == "README.md" and "for model in" in b.code for b in demo)
    assert {b.page for b in demo} >= {"README.md", "docs/api.md"}
    kinds = {kind: blocks_of(kind) for kind in ("vision", "backend", "config", "manifest")}
    assert all(kinds.values()), {kind: len(found) for kind, found in kinds.items()}


@pytest.mark.parametrize("block", blocks_of("config"), ids=lambda block: block.id)
def test_readme_config_files_load(block, tmp_path) -> None:  # type: ignore[no-untyped-def]
    suffix = {"toml": ".toml", "yaml": ".yaml"}[block.lang]
    path = tmp_path / f"config{suffix}"
    path.write_text(block.code)
    settings = load_settings(path)
    assert settings.model_fields_set


@pytest.mark.parametrize("block", blocks_of("backend"), ids=lambda block: block.id)
def test_readme_custom_backend_example_serves(block) -> None:  # type: ignore[no-untyped-def]
    """The custom-backend example, run as written (on a free port instead of 8001)."""
    port = free_port()
    code = block.code.replace("port=8001", f"port={port}")
    assert code != block.code, "the example no longer names port=8001"
    process = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                response = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "shouty", "messages": [{"role": "user", "content": "hi there"}]},
                    timeout=10,
                )
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the example server never listened"
                time.sleep(0.2)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "HI THERE"
    finally:
        process.terminate()
        process.wait(timeout=30)
