"""The status page of a catalog of base models in a real browser (headless Chromium): the
models table (residency, engine state, adapters, loads and unloads), the swaps, and the Load
and Unload buttons with the admin key; a single-model gateway's page without any of it.

Real gateways (in-process uvicorn) over real stand-in engine processes, as in test_catalog.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.demo.layout import demo_base_dir
from loragate.gateway.app import create_app
from loragate.settings import Settings
from tests.backend_double import serving
from tests.browser import console_errors, start_chromium, wait_until
from tests.unit.test_catalog import ADMIN, STAND_IN, catalog, catalog_settings, wait_for

KEY = ADMIN["Authorization"].removeprefix("Bearer ")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()


def shown(driver: Any, element_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return bool(driver.find_element(By.ID, element_id).is_displayed())


def model_cells(driver: Any) -> dict[str, dict[str, str]]:
    """Each model row's cells by class name, read in one go in the page (no stale rows)."""
    rows: dict[str, dict[str, str]] = driver.execute_script(
        """
        const rows = {};
        for (const row of document.querySelectorAll("#model-rows tr:not(.failure)")) {
          rows[row.dataset.model] = {};
          for (const cell of row.children) {
            if (cell.className) rows[row.dataset.model][cell.className.split(" ")[0]] =
              cell.textContent;
          }
        }
        return rows;
        """
    )
    return rows


def click(driver: Any, model: str, button: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def clicked() -> bool:
        try:
            found = driver.find_element(
                By.CSS_SELECTOR, f'#model-rows tr[data-model="{model}"] button.{button}'
            )
            if not found.is_enabled():
                return False
            found.click()
            return True
        except StaleElementReferenceException:
            return False

    wait_until(driver, clicked, f"an enabled {button} button for {model}", 20)


def residency_shown(driver: Any, model: str, residency: str) -> bool:
    return model_cells(driver).get(model, {}).get("residency") == residency


def test_the_models_table_shows_every_model_and_loads_and_unloads_by_hand(
    browser: Any, tmp_path: Path, demo_dir: Path
) -> None:
    from selenium.webdriver.common.by import By

    settings = catalog_settings(tmp_path, demo_dir, max_loaded_models=1, host="127.0.0.1")
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        browser.get(url + "/ui")
        # Without a key: every model, its residency and adapters, from the public routes.
        wait_until(browser, lambda: set(model_cells(browser)) == {"alpha", "beta"}, "both models")
        rows = model_cells(browser)
        assert rows["alpha"]["residency"] == "cold" and rows["alpha"]["adapters"] == "pong"
        assert rows["beta"]["adapters"] == "fox" and rows["beta"]["memory"] == "\N{EN DASH}"
        assert shown(browser, "models") and not shown(browser, "engine-restart")
        assert not browser.find_elements(By.CSS_SELECTOR, "#model-rows button")
        # With the key: memory, loads, the swaps, and the buttons.
        browser.find_element(By.ID, "admin-key").send_keys(KEY)
        browser.find_element(By.ID, "key-use").click()
        wait_until(browser, lambda: browser.find_element(By.ID, "models-swaps").text == "0",
                   "the swap count")  # fmt: skip
        assert "at most 1 loaded" in browser.find_element(By.ID, "models-room").text
        assert model_cells(browser)["beta"]["loads"] == "0 / 0"
        assert model_cells(browser)["beta"]["last-use"] == "never"

        click(browser, "beta", "load")
        wait_until(browser, lambda: residency_shown(browser, "beta", "resident"), "beta resident")
        assert model_cells(browser)["beta"]["state"] == "ready"
        # The load answers once the engine is on its way (its boot is the residency above).
        message = browser.find_element(By.ID, "models-message").text
        assert message.startswith(("beta: loading (", "beta: resident (")), message
        started = time.time()
        click(browser, "alpha", "load")  # a cap of one: beta makes room
        wait_until(browser, lambda: residency_shown(browser, "alpha", "resident"), "alpha loaded")
        wait_until(browser, lambda: residency_shown(browser, "beta", "cold"), "beta unloaded")
        wait_until(browser, lambda: browser.find_element(By.ID, "models-swaps").text == "1",
                   "the swap counted")  # fmt: skip
        last_swap = browser.find_element(By.ID, "models-last-swap").text
        assert last_swap.startswith("alpha loaded, beta unloaded at ")
        assert "loaded by an admin" in last_swap
        assert catalog(url)["_"]["last_swap"]["at"] >= started
        assert model_cells(browser)["beta"]["loads"] == "1 / 1"

        click(browser, "alpha", "unload")
        wait_until(browser, lambda: residency_shown(browser, "alpha", "cold"), "alpha unloaded")
        assert catalog(url)["alpha"]["residency"] == "cold"
        assert console_errors(browser) == []
        browser.get("about:blank")  # no polling of a stopped gateway


def test_a_single_model_page_has_no_models_table(
    browser: Any, tmp_path: Path, demo_dir: Path
) -> None:
    from selenium.webdriver.common.by import By

    settings = Settings(
        cache_dir=tmp_path / "cache",
        model=str(demo_base_dir(demo_dir)),
        engine_command=STAND_IN,
        probe_interval=0.2,
        admin_key=KEY,
        host="127.0.0.1",
    )
    with serving(create_app(settings)) as url:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        browser.get(url + "/ui")
        browser.execute_script("sessionStorage.clear()")  # the other test's key
        browser.refresh()
        console_errors(browser)  # drained: the other test's page, gone
        browser.find_element(By.ID, "admin-key").send_keys(KEY)
        browser.find_element(By.ID, "key-use").click()
        wait_until(
            browser,
            lambda: browser.find_element(By.ID, "engine-state").text == "ready",
            "the engine ready",
        )
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-catalog") == "no"
        assert not shown(browser, "models") and shown(browser, "engine-restart")
        assert browser.find_elements(By.ID, "engine-pid")  # the engine's facts, as before
        assert console_errors(browser) == []
