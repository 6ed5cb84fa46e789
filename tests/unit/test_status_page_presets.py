"""The status page's adapters table shows each adapter's preset in a real browser (headless
Chromium): a one-line summary of the serving version's preset, its whole JSON as the cell's
tooltip, following a swap; a dash for an adapter without one.

A real gateway (in-process uvicorn) over the stand-in engine process, as in test_presets.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import serving
from tests.browser import console_errors, start_chromium, wait_until
from tests.unit.test_presets import ADMIN, STAND_IN, put, wait_ready

KEY = ADMIN["Authorization"].removeprefix("Bearer ")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


def preset_cells(driver: Any) -> dict[str, tuple[str, str]]:
    """Each adapter row's preset cell: (its text, its tooltip), read in one go in the page."""
    cells: dict[str, tuple[str, str]] = driver.execute_script(
        """
        const cells = {};
        for (const row of document.querySelectorAll("#adapter-rows tr:not(.failure)")) {
          const cell = row.querySelector("td.preset");
          cells[row.dataset.name] = [cell.textContent, cell.title];
        }
        return cells;
        """
    )
    return {name: (text, title) for name, (text, title) in cells.items()}


def test_the_adapters_table_shows_the_serving_versions_preset(
    browser: Any, tmp_path: Path, demo_dir: Path
) -> None:
    from selenium.webdriver.common.by import By

    terse = {
        "system_prompt": "You answer in as few words as you possibly can, always.",
        "system_prompt_mode": "always",
        "defaults": {"temperature": 0.2},
        "clamps": {"max_tokens": 256},
        "stop": ["END"],
        "response_format": {"type": "json_object"},
    }
    settings = Settings(
        model=str(demo_base_dir(demo_dir)),
        cache_dir=tmp_path / "cache",
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key=KEY,
        host="127.0.0.1",
        adapter_source_roots=[demo_dir],  # the adapter the admin API is sent
    )
    with serving(create_app(settings)) as url:
        wait_ready(url)
        adapter = demo_adapter_dir(demo_dir, "pong")
        assert put(url, adapter, terse).status_code == 200
        browser.get(url + "/ui")
        browser.execute_script("sessionStorage.clear()")
        browser.refresh()
        console_errors(browser)  # drained: any earlier page, gone
        browser.find_element(By.ID, "admin-key").send_keys(KEY)
        browser.find_element(By.ID, "key-use").click()
        summary = (
            "system (always): “You answer in as few words as y…”; temperature=0.2; "
            'max_tokens≤256; stop: "END"; format: json_object'
        )  # read from GET /admin/adapters once the key is in (without it: names only)
        wait_until(
            browser, lambda: preset_cells(browser).get("fox", ("",))[0] == summary, "the preset"
        )
        title = preset_cells(browser)["fox"][1]
        assert json.loads(title) == terse

        wordy = {"system_prompt": "Be wordy.", "user_prompt": "Describe it.", "renderer": "qwen3"}
        assert put(url, adapter, wordy).status_code == 200  # the swap shows without a reload
        wanted = "system: “Be wordy.”; user prompt; renderer: qwen3"
        wait_until(browser, lambda: preset_cells(browser)["fox"][0] == wanted, "the new preset")

        plain = httpx.put(
            f"{url}/admin/adapters/plain", json={"source": str(adapter)}, headers=ADMIN, timeout=60
        )
        assert plain.status_code == 200, plain.text
        wait_until(browser, lambda: "plain" in preset_cells(browser), "the plain row")
        assert preset_cells(browser)["plain"] == ("\N{EN DASH}", "")
        assert console_errors(browser) == []
        browser.get("about:blank")  # no polling of a stopped gateway
