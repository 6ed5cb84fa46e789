"""Every code block in the README says how the suite runs it (or why it cannot)."""

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
    blocks = readme_blocks()
    assert blocks
    unmarked = [block.id for block in blocks if block.kind not in KINDS]
    assert not unmarked, f"README blocks without <!-- readme-test: KIND -->: {unmarked}"
    skipped = [block.id for block in blocks if block.kind == "skip" and not block.why]
    assert not skipped, f"README blocks skipped without saying why: {skipped}"


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
